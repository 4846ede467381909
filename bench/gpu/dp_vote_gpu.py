"""GPU check (2 GPUs, NCCL): the real DP sync and the graph-vs-eager hang, stock vs patched. Not part of CI.

Per rank: SGLang's real ServerArgs(device="cuda"), publish, init_distributed_environment(backend="nccl") and
initialize_model_parallel (tp=2, attn-dp=2), the plugin loaded through SGLang's load_plugins(). Then:
  1. the harness's real PD-decode round + DP MLP sync (harness/decode_round.py: real
     get_next_disagg_decode_batch_to_run, prepare_mlp_sync_batch_raw, ForwardBatch.init_new,
     EAGLEDraftCudaGraphRunner.can_run_graph; stand-ins in harness/standins.py) on the gloo CPU-group path and on
     the NCCL device-group path, rank 0 seedless, rank 1 idle:
     stock arm (plugin restored) and patched arm;
  2. each rank then runs the draft step's collectives as its decision says: replay of a captured CUDA graph holding
     3 NCCL all-gathers padded to 8 rows, or 3 eager all-gathers of the live rows. Patched first (expect completion
     and correct data), stock last (expect a hang: bounded by a host deadline; the parent kills what is left).
Run: bash bench/gpu/run.sh (on the device machine). NCCL multicast stays off.
"""

import inspect
import json
import os
import socket
import sys
import time
import traceback

for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1"),
             ("TORCH_NCCL_DUMP_ON_TIMEOUT", "0"), ("SGLANG_PLUGINS", "dp_mtp_fix")):  # fmt: skip
    os.environ[k] = v
import torch.multiprocessing as mp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
H, P, K = 1024, 8, 3
DEADLINE = 10.0
TOTAL = float(os.environ.get("GPU_TOTAL_S", "150"))


def worker(rank, world, port, q, t0):
    def rep(**kw):
        q.put(dict(rank=rank, t=round(time.time() - t0, 2), **kw))

    try:
        _worker(rank, world, port, rep)
    except BaseException as e:  # noqa: BLE001
        rep(error=f"{type(e).__name__}: {e}", tb=traceback.format_exc()[-3000:])
    finally:
        try:
            q.close()
            q.join_thread()
        except Exception:  # noqa: BLE001
            pass
        os._exit(0)  # never tear down a possibly wedged communicator


def _worker(rank, world, port, rep):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    from sglang_dp_mtp_fix import plugin
    from sglang_dp_mtp_fix.harness import rank as harness

    statuses = {o.id: o.status.value for o in (plugin.get_manager().outcomes or [])}
    sa = ServerArgs(model_path=os.path.join(HERE, "..", "..", "src", "sglang_dp_mtp_fix", "harness", "dummy_model"),
                    device="cuda", tp_size=world, dp_size=world, enable_dp_attention=True, skip_tokenizer_init=True,
                    load_format="dummy")  # fmt: skip
    harness.publish_server_args(sa, rank)  # runtime_context.publish from 0.5.17; set_global_server_args before
    if hasattr(ps, "set_custom_all_reduce"):
        ps.set_custom_all_reduce(False)
    kw = dict(backend="nccl", world_size=world, rank=rank, local_rank=rank,
              distributed_init_method=f"tcp://127.0.0.1:{port}")  # fmt: skip
    if "timeout" in inspect.signature(ps.init_distributed_environment).parameters:
        kw["timeout"] = 60
    ps.init_distributed_environment(**kw)
    if "tensor_model_parallel_size" in inspect.signature(ps.initialize_model_parallel).parameters:
        ps.initialize_model_parallel(tensor_model_parallel_size=world, attention_data_parallel_size=world)
    else:
        ps.initialize_model_parallel()
    tpg = ps.get_tp_group()
    gloo = dist.new_group(backend="gloo")
    context = harness.CONTEXT
    context.rank, context.world, context.path_group, context.device = rank, world, gloo, f"cuda:{rank}"
    context.server_args = context.baseline_server_args = sa
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    backend = str(dist.get_backend(tpg.device_group))
    rep(phase="init", plugin=statuses, torch=torch.__version__, gpu=torch.cuda.get_device_name(rank), nccl=nccl,
        device_group=backend)  # fmt: skip

    state = dict(kind="decode", seed=False, overlap=True) if rank == 0 else dict(kind="none")
    decisions = {}
    for arm in ("stock", "patched"):
        plugin.restore() if arm == "stock" else plugin.register()
        for path in ("cpu_group", "device_group"):
            if path == "device_group":
                os.environ["SGLANG_DP_MTP_FIX_HARNESS_DEVICE_GROUP"] = "1"
            else:
                os.environ.pop("SGLANG_DP_MTP_FIX_HARNESS_DEVICE_GROUP", None)
            for _ in range(3):  # warm-up rounds; the last one is reported
                r = harness.run_round(state)
            torch.cuda.synchronize()
            keep = ("draft_path", "decode_graph", "draft_vote", "forward_batch_draft_vote", "eager_cause",
                    "global_num_tokens", "sync_ms")  # fmt: skip
            rep(phase="sync", arm=arm, path=path, **{k: getattr(r, k) for k in keep})
            decisions[(arm, path)] = r.draft_path
    os.environ.pop("SGLANG_DP_MTP_FIX_HARNESS_DEVICE_GROUP", None)

    # 2. the draft step's collectives on NCCL, as each rank's decision says
    g_in = torch.full((P, H), float(rank + 1), device=dev)
    g_out = [torch.zeros((world * P, H), device=dev) for _ in range(K)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for o in g_out:
            dist.all_gather_into_tensor(o, g_in, group=tpg.device_group)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for o in g_out:
            dist.all_gather_into_tensor(o, g_in, group=tpg.device_group)
    torch.cuda.synchronize()

    def run(path, rows):
        if path == "graph":
            for o in g_out:
                o.zero_()
            graph.replay()
            return g_out, P
        outs = []
        for _ in range(K):
            o = torch.zeros((world * rows, H), device=dev)
            dist.all_gather_into_tensor(o, torch.full((rows, H), float(rank + 1), device=dev), group=tpg.device_group)
            outs.append(o)
        return outs, rows

    def poll(limit):
        ev = torch.cuda.Event()
        ev.record()
        ts = time.time()
        while not ev.query():
            if time.time() - ts > limit:
                return False, time.time() - ts
            time.sleep(0.002)
        return True, time.time() - ts

    live_rows = 1  # rank 0 holds one request; the idle rank pads to the live max in eager mode
    for arm in ("patched", "stock"):  # stock last: it is expected to hang
        path = decisions[(arm, "cpu_group")]
        dist.barrier(group=gloo)
        outs, rows = run(path, live_rows)
        done, el = poll(DEADLINE)
        correct = (
            all(bool((o[r * rows : (r + 1) * rows] == float(r + 1)).all()) for o in outs for r in range(world))
            if done
            else None
        )  # noqa: E501
        rep(phase="draft-step", arm=arm, path=path, rows_per_rank=rows, completed=done, seconds=round(el, 4),
            correct=correct)  # fmt: skip
        if not done:
            rep(phase="draft-step", arm=arm, note="GPU work still pending after the deadline: hung; exiting")
            return
    rep(phase="done")


def _free_port():
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


if __name__ == "__main__":
    world = 2
    t0 = time.time()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, q, t0)) for r in range(world)]
    for p in procs:
        p.start()
    msgs = []
    while time.time() - t0 < TOTAL:
        try:
            m = q.get(timeout=0.5)
            tb = m.pop("tb", None)
            msgs.append(m)
            print("MSG", json.dumps(m), flush=True)
            if tb:
                print(tb, flush=True)
        except Exception:  # noqa: BLE001
            pass
        if all(p.exitcode is not None for p in procs) and q.empty():
            break
    for p in procs:
        if p.exitcode is None:
            print(f"PARENT: rank {procs.index(p)} still running at {time.time() - t0:.1f}s -> SIGKILL", flush=True)
            p.kill()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"dp_vote_gpu-{os.environ.get('SGLANG_VERSION_LABEL', 'x')}.jsonl"), "w") as fh:
            fh.write("\n".join(json.dumps(m) for m in msgs) + "\n")
    sys.exit(0)
