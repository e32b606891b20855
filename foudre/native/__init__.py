"""Native code and what it needs: every C++ source of the package (the fused layer ops
``cpu_ops.cpp``, the quantized matmuls ``cpu_qmatmul.cpp``, the paged attention kernels
``cpu_paged_*.cpp``, the recurrent layers' state updates ``cpu_ssm.cpp``), their build and
loader (``build``: compiled on first use, cached by source, compiler, flags and CPU), and
weights in huge pages (``huge_pages``). The Python that calls each library lives beside its
users (``layers.fused``, ``quant.cpu_qmatmul``, ``attention.cpu_paged``, ``layers.ssm_ops``)."""
