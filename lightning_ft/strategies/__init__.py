"""Lightning plugins and strategies of lightning_ft."""
