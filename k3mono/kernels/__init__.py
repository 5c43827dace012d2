"""Triton device code of layer_post, one file per stage.

Each stage file holds: a module docstring (shape legend, the math), small
@triton.jit helpers, the ``_<stage>_kernel`` the staged driver launches, and
its ``launch_<stage>`` host function. The stage's device work lives in jit
functions that take a task index, so the mono launch composes the same code.

Shape legend: S tokens (SP padded), H hidden, E experts, K top-k, L latent,
I expert intermediate, SI shared intermediate, C core width, T ranks; a
``_r`` suffix marks one rank's shard (C/T, E/T, L/T, I/T, SI/T).

Nothing here imports k3mono.reference: the kernels are checked against it,
never built from it.
"""
