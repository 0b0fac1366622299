"""Hugging Face conversion at Llama-3-8B's real shape: import, logits, export, at the recipe's layout.

    python benchmarks/convert_at_scale.py --shard-size 2GB --out benchmarks/results/convert/F.json   # 8B, bf16
    python benchmarks/convert_at_scale.py --layers 8 --fp32-reference --out F.json  # full width, 8 layers
    python benchmarks/convert_at_scale.py --layers 2 --dtype fp32 --out F.json      # full width, fp32, 2 layers
    python benchmarks/convert_at_scale.py --layers 2 --hidden 256 --dry-run         # plumbing check, seconds

A randomly initialised ``transformers`` ``LlamaForCausalLM`` of Llama-3-8B's shape (32 layers, hidden 4096, 32
heads with 8 key/value groups, FFN 14336, vocabulary 128,256, RoPE θ 500,000, RMSNorm, untied output layer;
``--layers``/``--hidden`` shrink it) is saved with ``save_pretrained`` in ``--dtype`` (5 GB shards), and its
logits and loss on ``--batch`` random sequences of ``--seq`` tokens are taken as the reference. The model is
then freed, and ``--tp`` CPU processes (torchrun, gloo) import the checkpoint into ``GPTModule`` at tensor
parallelism ``--tp`` (the 8B recipe's layout, ``recipes/llama3-8b-tp2.yaml``), validate on the same tokens with
the recipe's ``layer_spec="sdpa"``, and export it back with ``export_hf`` (``--shard-size`` shards, 5 GB by
default, assembled one tensor at a time on rank 0). Recorded: every exported tensor bit-identical to the one
saved (``torch.equal``, read shard by shard), the config's fields, the logits' largest absolute and
relative-norm differences from ``transformers``, how often the two agree on the most likely next token, the
losses, each phase's time and each process's peak resident memory (which counts the checkpoint pages a process
read through safetensors' memory maps).

In bf16 the two implementations round in different orders, and the difference grows with depth over random
weights; ``--fp32-reference`` also runs ``transformers`` with the weights upcast to fp32, so both bf16 runs can be
compared with what they approximate. ``--dtype fp32`` with fewer layers (fp32 weights of all 32 layers need
64 GB) shows the conversion itself is exact to float32 rounding.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import provenance  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LLAMA3_8B = dict(
    num_hidden_layers=32,
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    vocab_size=128256,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=128001,
)
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def make_reference(args: argparse.Namespace, hf_dir: Path) -> dict[str, Any]:
    """Save a random Llama of the shape, and its logits and loss on random tokens; frees the model."""
    import torch
    import transformers

    shape = dict(LLAMA3_8B, num_hidden_layers=args.layers)
    if args.hidden:
        shape.update(hidden_size=args.hidden, intermediate_size=args.hidden * 7 // 2, num_attention_heads=8,
                     num_key_value_heads=2, vocab_size=4096)  # fmt: skip
    config = transformers.LlamaConfig(**shape)
    dtype = getattr(torch, DTYPES[args.dtype])
    torch.manual_seed(0)
    started = time.perf_counter()
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise in the saved dtype: an fp32 copy of 8B parameters is 32 GB
    try:
        model = transformers.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    parameters = sum(p.numel() for p in model.parameters())
    built = time.perf_counter()
    model.save_pretrained(hf_dir, max_shard_size="5GB")
    saved = time.perf_counter()
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1]).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    forward = time.perf_counter()
    logits_fp32 = None
    if args.fp32_reference and dtype != torch.float32:  # the same weights upcast: what both bf16 runs approximate
        with torch.no_grad():
            logits_fp32 = model.float()(input_ids=tokens[:, :-1]).logits.float()
    del model
    gc.collect()
    return {
        "config": config.to_dict(),
        "parameters": parameters,
        "tokens": tokens,
        "logits": logits,
        "logits_fp32": logits_fp32,
        "loss": float(loss),
        "seconds": {"build": built - started, "save_pretrained": saved - built, "forward": forward - saved},
    }


def worker(spec: dict[str, Any]) -> None:
    """One torchrun rank: import at TP, validate on the reference tokens, export; rank 0 writes its results."""
    import torch
    from megatron.core import parallel_state
    from torch.utils.data import DataLoader

    from lightning_megatron.convert import export_hf, hf_config_to_gpt_kwargs
    from lightning_megatron.models import GPTModule
    from lightning_megatron.models.loading import prepare

    class RecordingGPT(GPTModule):
        def forward_step(self, batch: dict, chunk: torch.nn.Module) -> tuple:
            output, loss_fn = super().forward_step(batch, chunk)

            def recording(out: torch.Tensor) -> Any:
                self.recorded.append(out.detach().float().clone())
                return loss_fn(out)

            return output, recording

    config = json.loads((Path(spec["hf_dir"]) / "config.json").read_text())
    kwargs = hf_config_to_gpt_kwargs(config)
    tokens = torch.load(spec["tokens"])
    started = time.perf_counter()
    module = RecordingGPT(
        **{**kwargs, "seq_length": tokens.shape[1] - 1}, layer_spec="sdpa", hf_checkpoint=spec["hf_dir"]
    )
    module.recorded = []
    batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    trainer = prepare(
        module,
        devices=spec["tp"],
        accelerator="cpu",
        precision="bf16-mixed" if spec["dtype"] == "bf16" else "32-true",
        micro_batch_size=tokens.shape[0],
        tensor_model_parallel_size=spec["tp"],
        strategy_options={"timeout": 3600},
    )
    imported = time.perf_counter()  # prepare's one-batch validation runs the import and a forward
    module.recorded.clear()
    (metrics,) = trainer.validate(module, dataloaders=DataLoader([batch], batch_size=None), verbose=False)
    validated = time.perf_counter()
    local = torch.cat(module.recorded)
    parts = [torch.empty_like(local) for _ in range(parallel_state.get_tensor_model_parallel_world_size())]
    torch.distributed.all_gather(parts, local, group=parallel_state.get_tensor_model_parallel_group())
    logits = torch.cat(parts, dim=-1)[..., : kwargs["vocab_size"]]
    hparams = {**dict(module.hparams), "seq_length": kwargs["seq_length"]}
    export_hf(module, spec["export_dir"], gpt_kwargs=hparams, max_shard_size=spec["shard_size"])
    exported = time.perf_counter()
    peaks = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(peaks, peak_rss_gib())
    if torch.distributed.get_rank() == 0:
        torch.save(
            {
                "logits": logits,
                "val_loss": float(metrics["val_loss"]),
                "seconds": {
                    "import_and_first_forward": imported - started,
                    "validate": validated - imported,
                    "export_hf": exported - validated,
                },  # fmt: skip
                "peak_rss_gib_per_rank": peaks,
            },
            spec["result"],
        )


def relative(got: Any, want: Any) -> float:
    return float((got - want).norm() / want.norm())


def compare_checkpoints(saved: Path, exported: Path) -> dict[str, Any]:
    """Tensor by tensor through safetensors' memory maps: names, dtypes and bits."""
    import torch
    from safetensors import safe_open

    def weight_map(folder: Path) -> dict[str, str]:
        index = folder / "model.safetensors.index.json"
        if index.exists():
            return json.loads(index.read_text())["weight_map"]
        with safe_open(folder / "model.safetensors", framework="pt") as f:
            return {name: "model.safetensors" for name in f.keys()}

    ours, theirs = weight_map(exported), weight_map(saved)
    differ, checked, total = [], 0, 0
    for name in sorted(set(ours) & set(theirs)):
        with (
            safe_open(saved / theirs[name], framework="pt") as a,
            safe_open(exported / ours[name], framework="pt") as b,
        ):
            x, y = a.get_tensor(name), b.get_tensor(name)
        checked += 1
        total += x.numel()
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            differ.append(name)
        del x, y
    return {
        "tensors_compared": checked,
        "elements_compared": total,
        "bit_identical": not differ and set(ours) == set(theirs),
        "differing": differ[:20],
        "missing_from_export": sorted(set(theirs) - set(ours))[:20],
        "extra_in_export": sorted(set(ours) - set(theirs))[:20],
        "exported_files": sorted(set(ours.values())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=32, help="transformer layers (default: Llama-3-8B's 32)")
    parser.add_argument("--hidden", type=int, default=None, help="a smaller width, for a plumbing check")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="saved weights and model (default bf16)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel CPU processes (default 2, the recipe's)")
    parser.add_argument("--batch", type=int, default=2, help="sequences compared (default 2)")
    parser.add_argument("--seq", type=int, default=32, help="tokens a sequence (default 32)")
    parser.add_argument(
        "--fp32-reference", action="store_true", help="also the transformers logits with the weights upcast to fp32"
    )
    parser.add_argument("--shard-size", default="5GB", help="export_hf's max_shard_size (default 5GB)")
    parser.add_argument("--workdir", type=Path, default=None, help="where the checkpoints go (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="the result JSON")
    parser.add_argument("--dry-run", action="store_true", help="print the result, write no JSON")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(json.loads(args.worker.read_text()))
        return
    if args.out is None and not args.dry_run:
        parser.error("--out is required (or --dry-run)")

    import torch

    work = Path(tempfile.mkdtemp(prefix="convert-at-scale-", dir=args.workdir))
    try:
        hf_dir, export_dir = work / "hf", work / "export"
        reference = make_reference(args, hf_dir)
        parent_peak = peak_rss_gib()
        torch.save(reference["tokens"], work / "tokens.pt")
        spec = {"hf_dir": str(hf_dir), "export_dir": str(export_dir), "tokens": str(work / "tokens.pt"),
                "result": str(work / "result.pt"), "tp": args.tp, "dtype": args.dtype,
                "shard_size": args.shard_size}  # fmt: skip
        (work / "spec.json").write_text(json.dumps(spec))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.tp}",
                   __file__, "--worker", str(work / "spec.json")]  # fmt: skip
        started = time.perf_counter()
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.tp))}
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"the {args.tp} ranks failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
        ranks_seconds = time.perf_counter() - started
        ours = torch.load(work / "result.pt")
        theirs = reference["logits"]
        diff = (ours["logits"] - theirs).abs()
        checkpoints = compare_checkpoints(hf_dir, export_dir)
        exported_config = json.loads((export_dir / "config.json").read_text())
        saved_config = json.loads((hf_dir / "config.json").read_text())
        changed = {k: [v, exported_config.get(k)] for k, v in saved_config.items() if exported_config.get(k) != v}
        result = {
            **provenance(),
            "what": "Hugging Face Llama-3-8B-shaped checkpoint imported at TP, validated, exported (CPU, gloo)",
            "shape": {k: reference["config"].get(k) for k in (*LLAMA3_8B, "rope_parameters", "head_dim")},
            "parameters": reference["parameters"],
            "dtype": args.dtype,
            "tensor_model_parallel_size": args.tp,
            "max_shard_size": args.shard_size,
            "tokens": list(reference["tokens"][:, :-1].shape),
            "logits": {
                "max_abs_diff": diff.max().item(),
                "max_abs_reference": theirs.abs().max().item(),
                "relative_norm_diff": relative(ours["logits"], theirs),
                "next_token_agreement": (ours["logits"].argmax(-1) == theirs.argmax(-1)).float().mean().item(),
            },
            "loss": {"transformers": reference["loss"], "gptmodule": ours["val_loss"]},
            "relative_norm_diff_from_fp32_transformers": None
            if reference["logits_fp32"] is None
            else {
                "gptmodule": relative(ours["logits"], reference["logits_fp32"]),
                "transformers": relative(theirs, reference["logits_fp32"]),
            },
            "export": checkpoints,
            "config_fields_changed": changed,
            "seconds": {**reference["seconds"], **ours["seconds"], "ranks_total": ranks_seconds},
            "peak_rss_gib": {"reference_process": parent_peak, "per_rank": ours["peak_rss_gib_per_rank"]},
        }
        text = json.dumps(result, indent=2)
        print(text)
        if not args.dry_run:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text + "\n")
        if not checkpoints["bit_identical"] or changed:
            sys.exit("the exported checkpoint differs from the saved one")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
