"""Loaded by pytest before any test module: the kernel tests need Triton built for its CPU interpreter, which works only
if that happens before anything else imports triton (the model imports the `kernels` package)."""

import kernels_interpreter  # noqa: F401
