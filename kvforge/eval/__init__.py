"""Model quality evaluation (perplexity over a fixed corpus)."""
