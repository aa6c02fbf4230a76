"""bench/big_model.py's last step, the trained model out: each capped rank writes its stage's shards
(`trainer.save_pretrained`) and a sha256 per tensor; the uncapped parent loads the directory with `from_pretrained`
and compares."""
from __future__ import annotations

import json
import time
from pathlib import Path

from model_parallel.runtime.observe.memory_probe import status_bytes


def export(trainer, tmp: Path, rank: int, baseline_rss: int) -> dict:
    """`trainer.save_pretrained(tmp/export)` on this capped rank (each rank writes only its stage's shards), and a
    sha256 per tensor of its stage in the original names (tmp/export-sha256-rank<R>.json) for the parent to compare.
    The RSS peak is reset first (/proc/self/clear_refs 5), so `export_peak_rss_bytes` is the export's own."""
    import hashlib

    from model_parallel.codegen.naming import original_state_from_stage
    from model_parallel.fileio import atomic_write_json

    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:  # not Linux: the peak then is the run's, not the export's alone
        pass
    before = status_bytes("VmRSS") - baseline_rss
    try:
        started = time.monotonic()
        trainer.save_pretrained(tmp / "export")
        seconds = time.monotonic() - started
    except (MemoryError, RuntimeError, ValueError) as error:
        return {"export_error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
    state = original_state_from_stage(trainer.graph, trainer.runner.named_state())
    atomic_write_json(tmp / f"export-sha256-rank{rank}.json",  # hashed in place: no copy of a tensor
                      {k: hashlib.sha256(v.detach().contiguous().numpy()).hexdigest() for k, v in state.items()})
    return {"export_seconds": round(seconds, 1), "export_rss_before_bytes": before,
            "export_peak_rss_bytes": status_bytes("VmHWM") - baseline_rss}


def check_export(tmp: Path, world: int) -> dict:
    """In the uncapped parent: `from_pretrained(tmp/export)` with no missing or unexpected key, every tensor's sha256
    that of the rank that trained it."""
    import hashlib

    import model_parallel  # noqa: F401  (the torchvision repair before transformers)
    import transformers

    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp / "export", output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as error:
        return {"ok": False, "error": f"from_pretrained: {type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    trained: dict = {}
    for rank in range(world):
        path = tmp / f"export-sha256-rank{rank}.json"
        trained.update(json.loads(path.read_text()) if path.is_file() else {})
    loaded = model.state_dict()
    different = sorted(k for k in trained if k not in loaded
                       or hashlib.sha256(loaded[k].contiguous().numpy()).hexdigest() != trained[k])
    files = len(list((tmp / "export").glob("*.safetensors")))
    ok = not info["missing_keys"] and not info["unexpected_keys"] and set(trained) == set(loaded) and not different
    return {"ok": ok, "tensors": len(loaded), "files": files, "missing": sorted(info["missing_keys"])[:3],
            "unexpected": sorted(info["unexpected_keys"])[:3], "different": different[:3],
            "untrained": sorted(set(loaded) - set(trained))[:3]}


def export_line(result: dict) -> str:
    if result.get("ok"):
        return f"exported: {result['tensors']} tensors in {result['files']} files, from_pretrained loads it, values equal"
    return f"export FAILED: {json.dumps(result)}"
