"""Masked-diffusion generation (LLaDA / Dream models, Fast-dLLM's parallel commits and caches);
docs/diffusion.md. The option names live here, torch-free, for SamplingParams' validation."""

REMASKING = ("low_confidence", "random", "entropy", "margin")
CACHE_MODES = ("none", "prefix", "dual")
