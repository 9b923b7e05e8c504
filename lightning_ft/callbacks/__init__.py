"""Lightning callbacks: throughput, and the end-of-run summary (summary.json, adapter export, loss plot)."""
