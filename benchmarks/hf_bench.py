"""Hugging Face models at scale: capture and profile of a Llama-7B config on the meta device, and pretrained weights
read per stage. Prints one JSON line per measurement.

    python benchmarks/hf_bench.py meta            # capture + profile a Llama-7B config on meta
    python benchmarks/hf_bench.py pretrained      # a ~300M GPT-2 saved, then read by 2 pipeline ranks

Each measurement runs in a fresh process, so its peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

GiB = 2**30


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _status(field: str) -> int:
    """A size from /proc/self/status (VmRSS, VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return -1


def _reset_peak() -> None:
    """Start VmHWM (the peak resident set) again from the current one."""
    Path("/proc/self/clear_refs").write_text("5")


def _disk_bytes() -> int:
    """Bytes this process has made the kernel read from disk (``read_bytes`` of /proc/self/io; mmap reads too)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return -1


def _drop_page_cache() -> bool:
    """Empty the page cache, so that reads come from disk and count (needs root); whether it could."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3")
    except OSError:
        return False
    return True


def meta() -> dict[str, Any]:
    """Build, capture and profile a Llama-7B config on the meta device; the reference is building it alone."""
    import transformers

    from stagewise.partition import auto, capture, profile

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
    )  # fmt: skip
    began = time.perf_counter()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).train()
    built = time.perf_counter() - began
    example = {"input_ids": torch.zeros(1, 2048, dtype=torch.long, device="meta")}
    began = time.perf_counter()
    chain = capture(model, example)
    captured = time.perf_counter() - began
    began = time.perf_counter()
    costs = profile(chain, example)
    profiled = time.perf_counter() - began
    part = auto(chain, 8, example, by="flops")
    params = sum(p.numel() for p in model.parameters())
    return {
        "case": "llama-7b on meta", "parameters": params, "segments": len(chain.segments),
        "build_s": round(built, 2), "capture_s": round(captured, 2), "profile_s": round(profiled, 2),
        "capture_and_profile_s": round(captured + profiled, 2),
        "x_build": round((captured + profiled) / built, 1),
        "peak_rss_gib": round(_peak_rss() / GiB, 2), "flops_per_token": sum(c.flops for c in costs) / 2048,
        "partition_8": list(part.bounds),
    }  # fmt: skip


def _gpt2_config() -> Any:
    import transformers

    # ~300M parameters: GPT-2 medium's width and depth with its vocabulary.
    return transformers.GPT2Config(
        n_layer=24, n_embd=1024, n_head=16, vocab_size=50257, n_positions=1024, bos_token_id=0, eos_token_id=0
    )


def save(folder: Path) -> dict[str, Any]:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_gpt2_config())
    model.save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return {"case": "saved", "parameters": params, "bytes_on_disk": size}


def _rank(folder: Path, whole: bool) -> dict[str, Any]:
    """One rank: the model captured on meta, its stage built, and its tensors read (``whole``: every tensor, as
    a rank must without stagewise: the reference)."""
    import torch.distributed as dist
    import transformers

    from stagewise.comm import init_mesh
    from stagewise.partition import Partition, capture
    from stagewise.pipeline import Pipeline, load_pretrained

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    mesh = init_mesh(2, timeout=600)
    if mesh.rank == 0:
        cold = _drop_page_cache()
    dist.barrier()
    rss, disk = _status("VmRSS"), _disk_bytes()
    _reset_peak()
    began = time.perf_counter()
    if whole:
        model = transformers.GPT2LMHeadModel.from_pretrained(folder)
        held = sum(p.numel() * p.element_size() for p in model.parameters())
        read, built = held, 0.0
    else:
        with torch.device("meta"):
            model = transformers.GPT2LMHeadModel(_gpt2_config()).train()
        chain = capture(model, {"input_ids": torch.zeros(1, 64, dtype=torch.long)})
        n = len(chain.segments)
        pipe = Pipeline(chain, Partition.from_bounds((0, n // 2, n)), n_microbatches=2,
                        loss_fn=lambda out, target: out.sum(), mesh=mesh)  # fmt: skip
        built = time.perf_counter() - began
        read = load_pretrained(pipe, folder).bytes_read
        held = sum(p.numel() * p.element_size() for p in pipe.parameters())
    seconds = time.perf_counter() - began
    peak = _status("VmHWM") - rss
    disk = _disk_bytes() - disk
    dist.barrier()
    dist.destroy_process_group()
    return {
        "rank": mesh.rank,
        "seconds": round(seconds, 2),
        "build_s": round(built, 2),
        "load_s": round(seconds - built, 2),
        "tensor_bytes_read": read,
        "parameter_bytes_held": held,
        "peak_rss_growth_gib": round(peak / GiB, 3),
        "disk_read_gib": round(disk / GiB, 3),
        "cold_cache": cold if mesh.rank == 0 else None,
    }


def pretrained(folder: Path) -> list[dict[str, Any]]:
    from stagewise.comm import launch

    out = []
    for whole in (True, False):
        results = launch(_rank, 2, folder, whole)
        for _, got in sorted(results.items()):
            out.append({"case": "from_pretrained on every rank" if whole else "stagewise per stage", **got})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["meta", "pretrained", "all"])
    parser.add_argument("--fresh", action="store_true", help=argparse.SUPPRESS)  # this process is the fresh one
    ns = parser.parse_args()
    if ns.what in ("meta", "all"):
        if ns.fresh:
            print(json.dumps(meta()), flush=True)
        else:
            subprocess.run([sys.executable, __file__, "meta", "--fresh"], check=True)
    if ns.what in ("pretrained", "all"):
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "gpt2-300m"
            print(json.dumps(save(folder)), flush=True)
            os.sync()
            for line in pretrained(folder):
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
