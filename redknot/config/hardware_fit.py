"""What accelerator this machine has, and whether a hardware option fits it.

Composition never looks at the device (``hardware=sm100`` composes, validates,
prepares and catalogs anywhere). The engine calls :func:`check_device` when it
starts; a mismatch names the device found and the hardware option that fits.
torch is imported lazily, only when a device is actually probed.
"""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from redknot.config.schema import Accelerator, HardwareConfig

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


@dataclass(frozen=True)
class DeviceFacts:
    """The accelerator torch sees: kind, count, first device's name, CC ("9.0") and driver."""
    accelerator: Accelerator
    count: int = 0
    name: str = "cpu"
    compute_capability: Optional[str] = None
    driver: Optional[str] = None


def detect() -> DeviceFacts:
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        return DeviceFacts(Accelerator.cuda, torch.cuda.device_count(), torch.cuda.get_device_name(0),
                           f"{major}.{minor}", _nvidia_driver())
    npu = getattr(torch, "npu", None)  # present once torch_npu is imported
    if npu is not None and npu.is_available():
        return DeviceFacts(Accelerator.npu, npu.device_count(), npu.get_device_name(0))
    return DeviceFacts(Accelerator.cpu, 0, _cpu_name())


def describe() -> DeviceFacts:
    """Device facts for run records, without importing torch just for that.

    torch's own view when torch is loaded; else ``nvidia-smi`` (name, compute
    capability, driver); else torch after all if an NVIDIA driver or torch_npu is
    present; else the CPU.
    """
    if "torch" in sys.modules:
        return detect()
    smi = _nvidia_smi_facts()
    if smi is not None:
        return smi
    if Path("/proc/driver/nvidia").exists() or importlib.util.find_spec("torch_npu") is not None:
        return detect()
    return DeviceFacts(Accelerator.cpu, 0, _cpu_name())


def fits(hardware: HardwareConfig, facts: DeviceFacts) -> bool:
    if hardware.accelerator == Accelerator.cpu:
        return True  # the reference path runs anywhere
    if hardware.accelerator != facts.accelerator:
        return False
    if not hardware.compute_capability:
        return True
    return any(facts.compute_capability and facts.compute_capability.startswith(cc)
               for cc in hardware.compute_capability)


def fitting_options(facts: DeviceFacts, options: Optional[Dict[str, HardwareConfig]] = None) -> List[str]:
    """Hardware options that run on this device, most specific first (cpu last)."""
    options = load_hardware_options() if options is None else options
    names = [name for name, hw in sorted(options.items()) if fits(hw, facts)]
    return sorted(names, key=lambda n: options[n].accelerator == Accelerator.cpu)


def check_device(hardware: HardwareConfig, facts: Optional[DeviceFacts] = None) -> DeviceFacts:
    """Raise ``RuntimeError`` when ``hardware`` cannot run on the device found."""
    facts = detect() if facts is None else facts
    if fits(hardware, facts):
        return facts
    found = f"no accelerator (CPU: {facts.name})" if facts.accelerator == Accelerator.cpu else (
        f"{facts.count} x {facts.name}" + (f" (compute capability {facts.compute_capability})"
                                           if facts.compute_capability else ""))
    wanted = f"accelerator {hardware.accelerator.value}"
    if hardware.compute_capability:
        wanted += f" with compute capability {' or '.join(hardware.compute_capability)}"
    hints = ", ".join(f"hardware={n}" for n in fitting_options(facts))
    raise RuntimeError(f"hardware={hardware.name} needs {wanted}, but this machine has {found}; "
                       f"options that fit: {hints or 'none'}")


def load_hardware_options(conf_dir: Path = CONF_DIR) -> Dict[str, HardwareConfig]:
    """Every ``conf/hardware/*.yaml``, typed (read with OmegaConf; no Hydra needed)."""
    from omegaconf import OmegaConf

    options = {}
    for path in sorted((conf_dir / "hardware").glob("*.yaml")):
        merged = OmegaConf.merge(OmegaConf.structured(HardwareConfig), OmegaConf.load(path))
        options[path.stem] = OmegaConf.to_object(merged)
    return options


def _nvidia_smi(fields: str) -> List[List[str]]:
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [[part.strip() for part in line.split(",")] for line in out.strip().splitlines() if line.strip()]


def _nvidia_driver() -> Optional[str]:
    rows = _nvidia_smi("driver_version")
    return rows[0][0] if rows else None


def _nvidia_smi_facts() -> Optional[DeviceFacts]:
    rows = _nvidia_smi("name,compute_cap,driver_version")
    if not rows or len(rows[0]) != 3:
        return None
    name, cc, driver = rows[0]
    return DeviceFacts(Accelerator.cuda, len(rows), name, cc, driver)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "cpu"
