"""The machine: what it is (`machine`: CPU, ISA flags, caches from sysfs) and how memory is
had from it (`memory`: huge-page buffers, the weight arena). What it can do, measured with
our kernels, is one floor up: `workbench.kernels.peaks`."""

from workbench.hw.machine import MachineInfo, machine_info

__all__ = ["MachineInfo", "machine_info"]
