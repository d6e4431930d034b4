#!/usr/bin/env bash
# Silent data corruption on two GPUs (issue 51; device tool, 2 GPUs, NCCL, <= 8 minutes). A 4-layer GPT-2 under DDP,
# bf16 autocast, deterministic algorithms, DetectionConfig(silent=...): faults injected on cuda:1 (rank 1) — a transient
# bit flip in a block's MLP output, a stuck fault there, a bit flipped in rank 1's copy of a weight — each must be caught
# at its step (10) and dumped by both ranks; rank 1's dump is then replayed on cuda:0 and must be classed transient /
# persistent / replica drift with the module and rank 1; the transient dump is replayed on cuda:1 too (the job's own
# device: does the device index matter?); the same flip under FSDP2 (bf16 parameters) likewise. Healthy runs checked at
# every step (DDP: recompute, cross-rank, replicas; FSDP2: the forward recompute) must raise nothing. A probe shows
# whether SDPA's output (dropout on) depends on the deterministic mode's warn-only flag (cuDNN attention is left out of
# SDPA's choice in the strict mode). Then the cost bench: the recompute on GPT-2 small on one GPU, the replica check on
# DDP over the two GPUs (scripts/bench/silent_overhead.py).
# OUTDIR gets two files: summary.txt and sdc_logs.tar.gz (every log, the bench JSON, and per replay diag-*.json: the
# report's silent block with its module-by-module comparison, the verdict, the job's determinism block). Dumps and
# reports stay in a work directory outside OUTDIR ($SDC_WORK, default /tmp/gpu_sdc_work).
# Usage (repo root, .whl carried): bash scripts/gpu_sdc.sh OUTDIR
set -uo pipefail
out=${1:-/tmp/gpu_sdc}; mkdir -p "$out"
work=${SDC_WORK:-/tmp/gpu_sdc_work}; rm -rf "$work"; mkdir -p "$work/logs" "$work/code"
logs=$work/logs
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:$work/code PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
: > "$out/summary.txt"
pack() { tar -czf "$out/sdc_logs.tar.gz" -C "$work" logs; }
trap pack EXIT
nvidia-smi -L | tee "$logs/gpus.txt" | tee -a "$out/summary.txt"
date -u +"%Y-%m-%d %H:%M UTC" | tee "$logs/date.txt" | tee -a "$out/summary.txt"
failed=0
cat > "$work/code/sdc_gpu_models.py" <<'EOF'
import torch
from transformers import GPT2Config, GPT2LMHeadModel

def build():
    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=128, vocab_size=4096,
                        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    return GPT2LMHeadModel(config)

def loss(model, batch):
    return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
EOF
cat > "$work/code/sdc_gpu_job.py" <<'EOF'
import json, math, os, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from forensics.capture import DetectionConfig, DumpConfig, FaultSpec, Guard, GuardConfig, SilentConfig
import sdc_gpu_models

dist.init_process_group("nccl")
rank = dist.get_rank(); device = torch.device("cuda", int(os.environ["LOCAL_RANK"])); torch.cuda.set_device(device)
torch.use_deterministic_algorithms(True)
MLP = "transformer.h.1.mlp.c_fc"
SCENARIOS = {
    "transient": (13, SilentConfig(recompute_every=5, replica_every=0, on_mismatch="skip",
                                   inject=FaultSpec("output:" + MLP, rank=1, step=10, bit=2))),
    "stuck": (13, SilentConfig(recompute_every=5, replica_every=0, on_mismatch="skip",
                               inject=FaultSpec("output:" + MLP, rank=1, step=10, bit=2, stuck=True))),
    "drift": (11, SilentConfig(recompute_every=0, replica_every=5, on_mismatch="skip",
                               inject=FaultSpec("weight:transformer.h.2.attn.c_attn.weight", rank=1, step=10, bit=3))),
    "healthy": (200, SilentConfig(recompute_every=1, replica_every=1)),
    "fsdp_flip": (13, SilentConfig(recompute_every=5, on_mismatch="skip",
                                   inject=FaultSpec("output:" + MLP, rank=1, step=10, bit=2))),
    "fsdp_healthy": (100, SilentConfig(recompute_every=1)),
}


def sharded(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)
results = {}
for name, (steps, silent) in SCENARIOS.items():
    model = sdc_gpu_models.build().to(device)
    fsdp = name.startswith("fsdp")
    wrapped = model = sharded(model) if fsdp else DistributedDataParallel(model, device_ids=[device.index])
    model = model if fsdp else wrapped.module
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=not fsdp)
    config = GuardConfig(dump_dir=sys.argv[1] + "/" + name, run_id="sdc", detection=DetectionConfig(silent=silent),
                         dumping=DumpConfig(recipe={"factory": "sdc_gpu_models:build", "loss": "sdc_gpu_models:loss"}))
    guard = Guard(wrapped, optimizer, config=config, loss_fn=sdc_gpu_models.loss)
    losses, decisions = [], []
    for step in range(steps):
        total = 0.0
        for micro in range(2):
            g = torch.Generator(device=device).manual_seed(1000 * step + 10 * rank + micro)
            batch = {"input_ids": torch.randint(0, 4096, (4, 128), device=device, generator=g),
                     "sample_ids": [f"r{rank}s{step}m{micro}i{i}" for i in range(4)]}
            guard.record_batch(batch)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = sdc_gpu_models.loss(wrapped, batch)
            guard.record_loss(loss)
            (loss / 2).backward()
            total += float(loss.detach()) / 2
        losses.append(total)
        ok = guard.check(grad_norm=torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        decisions.append(ok)
        if ok:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    guard.close()
    results[name] = {"dumps": [str(p) for p in guard.dumps], "finite": all(map(math.isfinite, losses)),
                     "injected": guard.silent.injector.injected if guard.silent.injector else [],
                     "skipped": [i for i, d in enumerate(decisions) if not d]}
sys.stdout.write(f"rank {rank} " + json.dumps(results) + "\n"); sys.stdout.flush()
dist.barrier(); dist.destroy_process_group()
EOF
cat > "$work/code/sdc_probe.py" <<'EOF'
# SDPA with dropout, the same inputs and RNG, under the strict deterministic mode (the job's), the warn-only mode (the
# replay's before the fix) and the warn-only mode with cuDNN attention off (the replay's now, for a strict job).
import torch
torch.manual_seed(0)
q, k, v = (torch.randn(4, 4, 128, 64, device="cuda:0", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))


def run(strict, cudnn=True):
    torch.use_deterministic_algorithms(True, warn_only=not strict)
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    torch.cuda.manual_seed(7)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True).detach()


strict, loose, loose_no_cudnn = run(True), run(False), run(False, cudnn=False)
print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name(0))
print("SDPA strict == warn-only:", torch.equal(strict, loose))
print("SDPA strict == warn-only without cuDNN attention:", torch.equal(strict, loose_no_cudnn))
EOF
cat > "$work/code/sdc_diag.py" <<'EOF'
# One replay's diagnostics: check class / module / rank, print a summary, write diag JSON (silent block, verdict,
# the job's determinism block). Args: report.json class module-substring rank-dump-dir diag-out.
import json, sys
r = json.load(open(sys.argv[1])); s = r["silent"]
manifest = json.load(open(sys.argv[4] + "/manifest.json"))
diag = {"silent": s, "verdict": r["verdict"], "fidelity": r.get("fidelity"), "environment": r.get("environment"),
        "job_determinism": manifest.get("determinism")}
json.dump(diag, open(sys.argv[5], "w"), indent=1)
print(f"  class {s['class']} module {s['module']} drain_rank {s['drain_rank']} evidence {s.get('evidence')} "
      f"replay_parted {s.get('replay_parted')} reference_replayed {s.get('reference_replayed')} "
      f"replay_vs_reference {s.get('replay_vs_reference')} comparable {s['comparable']}")
print(f"  job device {s['device'].get('name')} {s['device'].get('pci_bus_id')}, replay index "
      f"{s['replay_device'].get('index')}; job determinism {json.dumps(manifest.get('determinism'))[:400]}")
print("  " + r["verdict"]["headline"][:300])
ok = s["class"] == sys.argv[2] and sys.argv[3] in str(s["module"]) and s["drain_rank"] == 1
print("  OK" if ok else "  UNEXPECTED"); sys.exit(0 if ok else 1)
EOF
timeout 60 python3 "$work/code/sdc_probe.py" > "$logs/sdpa_probe.log" 2>&1
echo "SDPA probe:" | tee -a "$out/summary.txt"; tail -3 "$logs/sdpa_probe.log" | tee -a "$out/summary.txt"
start=$SECONDS
( cd "$work/code" && timeout 300 torchrun --nproc_per_node=2 sdc_gpu_job.py "$work/dumps" ) > "$logs/job.log" 2>&1
echo "job exit $? in $((SECONDS - start)) s" | tee -a "$out/summary.txt"
grep -E "^rank [01] " "$logs/job.log" | cut -c1-600 | tee -a "$out/summary.txt"
grep -E "disagree|drift" "$logs/job.log" | cut -c1-250 | head -8
expect() {  # scenario class module-substring device: replay rank 1's dump of step 10 there, check class/module/rank
  local name=$1 class=$2 module=$3 device=$4 dir="$work/dumps/$1/sdc/step-000000010"
  local tag="$1-${4/:/}" start=$SECONDS
  timeout 120 python3 -m forensics.cli replay "$dir" --rank 1 --device "$device" --trust --path "$work/code" \
    -o "$work/replay-$tag" > "$logs/replay-$tag.log" 2>&1
  echo "replay $name on $device exit $? in $((SECONDS - start)) s" | tee -a "$out/summary.txt"
  python3 "$work/code/sdc_diag.py" "$work/replay-$tag/report.json" "$class" "$module" "$dir/rank-00001" \
    "$logs/diag-$tag.json" 2>&1 | tee -a "$out/summary.txt" || failed=1
}
expect transient transient "mlp.c_fc" cuda:0
expect transient transient "mlp.c_fc" cuda:1
expect stuck persistent "mlp.c_fc" cuda:0
expect drift replica_drift "c_attn.weight" cuda:0
expect fsdp_flip transient "mlp.c_fc" cuda:0
for name in healthy fsdp_healthy; do
  n=$(find "$work/dumps/$name" -name 'rank-*' 2>/dev/null | wc -l)
  echo "$name run (every check at every step, bf16): $n rank dumps (expected 0)" | tee -a "$out/summary.txt"
  [ "$n" -eq 0 ] || failed=1
done
timeout 150 python3 -m scripts.bench.silent_overhead --rounds 3 --steps 24 --json "$logs/bench_recompute.json" \
  > "$logs/bench_recompute.log" 2>&1
echo "bench recompute (1 GPU):" | tee -a "$out/summary.txt"; tail -3 "$logs/bench_recompute.log" | tee -a "$out/summary.txt"
timeout 150 torchrun --nproc_per_node=2 -m scripts.bench.silent_overhead --ddp --rounds 3 --steps 24 \
  --json "$logs/bench_ddp.json" > "$logs/bench_ddp.log" 2>&1
echo "bench DDP (2 GPUs):" | tee -a "$out/summary.txt"
grep -E "^(guarded|recompute|replicas)" "$logs/bench_ddp.log" | tee -a "$out/summary.txt"
echo "failed=$failed" | tee -a "$out/summary.txt"
exit $failed
