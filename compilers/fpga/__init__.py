"""FPGA back ends: HLS projects (TVM's C, a top function, a C testbench) checked by C simulation."""
