"""A tensor-parallel worker: rank r >= 1 of the group, in its own process, one device.

It holds its shard of the model and its own ModelRunner (block tables, KV heads of its shard,
sampling state), and runs every plan rank 0 sends, in order:

    pipe from rank 0        ("launch", plan dict, only)   run it: the same collectives as every rank;
                                                           sample as rank 0 does (same logits, same
                                                           seeded generators), so device-side tokens
                                                           of the next step are here too
                            ("apply", plan dict)           take its table and request changes only
                            ("stop",)                      leave the group and exit
    pipe to rank 0          ("up",) ("loaded",) ("ready",) start-up stages; ("error", traceback)

Any failure is fatal for the group (collectives would no longer pair up): the worker reports it and
exits; rank 0 turns that into an error naming this rank. If rank 0 goes away the pipe ends (EOF) and
the worker exits.
"""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch

from ...config.engine import EngineConfig
from ...models.tensor_parallel import DistributedCommunicator, TensorParallelShard
from ..model_runner import RunnerKV, RunnerOptions

HOST = "127.0.0.1"
# Collectives run only while every rank computes the same step, so a rank waits on another for at
# most the skew between them (first-call compilation, a slow core); past this, a peer is stuck.
COLLECTIVE_TIMEOUT_S = 300


@dataclass(frozen=True)
class WorkerArgs:
    config: EngineConfig
    rank: int
    world_size: int
    store_port: int
    device: str
    threads: int


@dataclass(frozen=True)
class RunnerSpec:
    """What rank 0 decided that every rank's runner needs: the KV layout of the shared schedule and the
    runner's options."""

    backend: str
    kv: RunnerKV
    options: RunnerOptions


def join_group(rank: int, world_size: int, store, device: torch.device) -> DistributedCommunicator:
    """Join the default torch.distributed group (NCCL on CUDA, gloo on the CPU) through `store`."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return DistributedCommunicator(None, rank, world_size)


def worker_main(args: WorkerArgs, conn) -> None:
    """The worker process's entry point (torch.multiprocessing, spawn)."""
    import signal

    import torch.distributed as dist

    # Ctrl-C reaches the whole process group: rank 0 decides (a server drains first), workers follow it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        device = torch.device(args.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(args.threads)
        conn.send(("up",))
        store = dist.TCPStore(HOST, args.store_port, args.world_size, is_master=False,
                              timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        comm = join_group(args.rank, args.world_size, store, device)
        _serve(args, device, comm, conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass   # rank 0 is gone: nothing to report to
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve(args: WorkerArgs, device: torch.device, comm: DistributedCommunicator, conn) -> None:
    from ...attention import select_backend
    from ...models.loader import load_model
    from ..spec_decode.draft_model import DraftModelDrafter
    from ..spec_decode.build import draft_model, mtp_drafter
    from ..model_runner import ModelRunner
    from ..structured.structured_output import Grammars
    from ..step import StepPlan

    config = args.config
    dtype = config.torch_dtype(device)
    loaded = load_model(config.model, dtype, device, config.quantized_weights(device),
                        shard=TensorParallelShard(args.rank, args.world_size, comm), quantization=config.quantization,
                        mmproj=config.mmproj, hub=config.hub_options())
    conn.send(("loaded",))
    spec: RunnerSpec | tuple = conn.recv()
    if spec == ("stop",):   # rank 0 gave up while this rank was loading
        return
    backend = select_backend(spec.backend, device, spec.kv.specs)
    drafter = mtp_drafter(config, loaded.model, backend, dtype, device)   # None unless MTP drafts
    draft = draft_model(config, loaded, dtype, device)   # this rank's shard of a draft model, if one drafts
    if draft is not None:   # its layers follow the target's in the pool, as on rank 0
        first = len(loaded.model.kv_layer_specs(config.torch_kv_dtype(dtype)))
        drafter = DraftModelDrafter(draft.model, backend, first, loaded.tokenizer.pad_token_id or 0)
    runner = ModelRunner(loaded.model, backend, device, spec.kv, spec.options,
                         Grammars(loaded.tokenizer, loaded.model.vocab_size), drafter)
    conn.send(("ready",))
    while True:
        msg = pickle.loads(conn.recv_bytes())
        if msg[0] == "stop":
            return
        plan = StepPlan.from_dict(msg[1])
        if msg[0] == "apply":
            runner.apply(plan)
        else:
            runner.launch(plan, msg[2])   # the sampled ids stay on this device for the next step
