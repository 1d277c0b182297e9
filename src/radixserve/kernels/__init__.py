"""The kernel layer: how this process computes, decided in one place.

* ``isa``: the CPU's features and the instruction-set cap (``$RADIXSERVE_CPU_ISA``,
  ``EngineConfig.cpu_isa``); torch-free, so ``import radixserve`` caps torch's libraries
  before torch's first use.
* ``library``: the C++ kernels of ``csrc/`` — their build (once per machine, cached) and their
  Python face (``Kernels``: attention over the paged pool, row ops, packed GEMMs, whole decoder
  layers in one call), with per-ISA dispatch inside the C++.
* ``linear``: the linear-layer backends and the choice among them.
* ``dtype_choice``: ``--dtype auto``, by CPU features.

Model code takes a ``Kernels`` view and a ``Linears`` from here and calls their ops; it never
asks which instruction set it runs on. Nothing is imported here: see ``isa``.
"""
