"""The machine: what it is (`machine`: CPU, ISA flags, caches from sysfs) and what it can do
(`peaks`: measured memory bandwidth and FMA throughput, cached per CPU and thread count).
Every "% of peak" in the workbench divides by `measured_peaks()`."""

from workbench.hw.machine import MachineInfo, machine_info
from workbench.hw.peaks import Peaks, measured_peaks

__all__ = ["MachineInfo", "Peaks", "machine_info", "measured_peaks"]
