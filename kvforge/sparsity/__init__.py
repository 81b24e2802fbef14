"""Training-free activation sparsity for batch-1 decode (TEAL, CATS).

``config.py`` validates the options, ``masking.py`` applies a set of thresholds to a model's
Python layers (the reference, perplexity and calibration), ``calibrate.py`` computes per-layer
thresholds on shipped text, ``cache.py`` keeps them per model and target, ``decode.py`` gives
the compiled decode stack its input-sparse projections (``kernels/csrc/sparse_gemv.cpp``).
docs/activation_sparsity.md has the measurements.
"""
