"""GPU check (1 GPU): does loading the plugin create a CUDA context, and on which device? Not part of CI.

A scheduler process runs ``load_plugins()`` before it selects its GPU (``torch.cuda.set_device``). A CUDA context
created while the plugin loads would land on device 0 in every DP rank's process. Each case runs in a fresh
process, in a scheduler's import order: import ``sglang.srt.managers.scheduler``, then SGLang's ``load_plugins()``
with the plugin selected (patched) or not (stock), then — on the DSA path — import the DSA attention modules as a
DSA model's load would (the plugin applies its DSA patches when they are imported). Then it looks for a context in
two independent ways:
  * the driver API: ``cuDevicePrimaryCtxGetState`` per device (``cuInit`` itself creates no context);
  * NVML's per-process list (``nvidia-smi --query-compute-apps=pid``) for this PID.
Positive control, same process: allocate on ``cuda:0``, then the same two probes must see it (else "no context"
would prove nothing, e.g. in a PID namespace NVML cannot see). ``torch.cuda.is_initialized()`` is reported as well; it
is not a context (SGLang's imports set it, stock and patched alike, while neither probe sees a context).
Output: one ``RESULT {...}`` JSON line per case; the parent prints a ``SUMMARY`` line.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

DSA_MODULES = ("sglang.srt.layers.attention.dsa_backend", "sglang.srt.layers.attention.dsa.dsa_indexer")
VERSION = os.environ.get("SGLANG_VERSION_LABEL", "?")


def primary_contexts() -> list[int]:
    """Ordinals of the devices whose primary CUDA context is active in this process."""
    lib = ctypes.CDLL("libcuda.so.1")
    if lib.cuInit(0) != 0:
        raise RuntimeError("cuInit failed")
    count = ctypes.c_int()
    lib.cuDeviceGetCount(ctypes.byref(count))
    active = []
    for ordinal in range(count.value):
        device, flags, state = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        lib.cuDeviceGet(ctypes.byref(device), ordinal)
        lib.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(state))
        if state.value:
            active.append(ordinal)
    return active


def nvml_lists_me() -> bool | None:
    """Does NVML list this PID as a compute process? None when nvidia-smi cannot answer."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip
    except Exception:  # noqa: BLE001
        return None
    return str(os.getpid()) in {line.strip() for line in out.splitlines()}


def probe() -> dict[str, object]:
    import torch

    return {"torch_cuda_initialized": torch.cuda.is_initialized(), "primary_contexts": primary_contexts(),
            "nvml_lists_pid": nvml_lists_me()}  # fmt: skip


def case(arm: str, path: str) -> dict[str, object]:
    os.environ["SGLANG_PLUGINS"] = "dp_mtp_fix" if arm == "patched" else "no_plugin_selected"
    import sglang.srt.managers.scheduler  # noqa: F401 - a scheduler process's state when SGLang loads plugins
    from sglang.srt.plugins import load_plugins

    load_plugins()
    imported, import_errors = [], {}
    if path == "dsa":
        import importlib

        for name in DSA_MODULES:
            try:
                importlib.import_module(name)
                imported.append(name)
            except Exception as exc:  # noqa: BLE001 - reported: a DSA module that cannot load here
                import_errors[name] = f"{type(exc).__name__}: {exc}"[:300]
    statuses = None
    if "sglang_dp_mtp_fix.plugin" in sys.modules:
        from sglang_dp_mtp_fix import plugin

        statuses = {o.id: o.status.value for o in plugin.get_manager().outcomes or []}
    before = probe()
    import torch

    torch.zeros(1, device="cuda:0")
    torch.cuda.synchronize()
    control = probe()
    # A context is what the driver and NVML see. torch's is_initialized() is reported too but is not a context:
    # SGLang's own imports initialize torch's CUDA state (device count, capability) without creating one.
    no_context = not (before["primary_contexts"] or before["nvml_lists_pid"])
    control_seen = 0 in control["primary_contexts"] and control["nvml_lists_pid"] is not False
    return {
        "sglang": VERSION, "arm": arm, "path": path, "plugin_statuses": statuses, "dsa_imported": imported,
        "dsa_import_errors": import_errors, "after_load": before, "after_control_alloc_on_cuda0": control,
        "control_seen": control_seen, "verdict": ("no context" if no_context else "CONTEXT CREATED")
        if control_seen else "inconclusive (the control was not seen)",
    }  # fmt: skip


def main() -> int:
    if len(sys.argv) == 3:
        print("RESULT " + json.dumps(case(sys.argv[1], sys.argv[2])), flush=True)
        return 0
    results = []
    for arm in ("stock", "patched"):
        for path in ("plain", "dsa"):
            proc = subprocess.run([sys.executable, __file__, arm, path], capture_output=True, text=True, timeout=300)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(f"CASE {arm}/{path} failed rc={proc.returncode}: {proc.stderr[-1500:]}", flush=True)
                continue
            print(lines[-1], flush=True)
            results.append(json.loads(lines[-1][7:]))
    verdicts = {f"{r['arm']}/{r['path']}": r["verdict"] for r in results}
    print("SUMMARY " + json.dumps({"sglang": VERSION, "verdicts": verdicts}), flush=True)
    return 0 if len(results) == 4 and all(v == "no context" for v in verdicts.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
