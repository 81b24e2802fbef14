"""Masked-diffusion generation (LLaDA / Dream models, Fast-dLLM's parallel commits and caches);
docs/diffusion.md."""
