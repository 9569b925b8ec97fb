"""triton_static: what Triton kernels compile to for a Hopper GPU (sm_90a), and a model of their
time on an H200, on a machine without a GPU. Every time it gives is modelled, not measured.

- `launches`: a Python call's kernel launches recorded instead of run, each bound as a real
  launch binds it and compiled for sm_90a (`recording`, `compile_launch`);
- `sass`: a compiled kernel read back (registers, spills, shared memory, SASS, MMA form, loops);
- `counts`: the work of a call's kernels counted through the Triton interpreter (bytes per
  storage, dot FLOPs, transcendentals, source-line counts), in this process or a subprocess;
- `model`: one launch's modelled time from its code and counts;
- `calls`: a call's launches and counts to per-launch entries and the call's modelled time.

It leans on Triton internals (README.md lists them and the versions it is known to work with).
"""
