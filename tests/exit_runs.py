"""Short training jobs whose only verdict is how their ranks end (issue 48): exit status 0 and
no `terminate called` on stderr, whatever the strategy, the checkpoint mode and the way the
script ends.

Each run is a nanoGPT-shaped loop (gradient accumulation with `require_backward_grad_sync`, a
rank-0-only evaluation, a checkpoint at the eval interval) on 2 gloo ranks. The ranks are forked
from one parent that imported torch and megabuf once (a run costs its training, not two
interpreter start-ups), and each rank leaves through the interpreter's ordinary exit path: atexit
handlers, finalizers and interpreter teardown run as in a torchrun job, which is what can abort.
The parent can keep the CPU loaded while the ranks run (busy processes), as the report that
started this had it.

`python tests/exit_runs.py [--repeat N] [--load K] [--jobs J] [--only SUBSTR]` runs the matrix,
J runs at a time, and prints one line per run; `tests/test_exit_status.py` runs it under pytest;
`make test-exit` repeats it.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

STRATEGIES = (
    ("no_shard", False),
    ("optim", False),
    ("optim", True),
    ("optim_grads", False),
    ("optim_grads", True),
    ("optim_grads_params", False),  # gathers in forward: overlap_param_gather does not apply
)
# checkpoint: none; synchronous; asynchronous and waited for; asynchronous, never waited for
# (the save in flight when the script ends)
CHECKPOINTS = ("none", "sync", "async", "async_unwaited")
# how the script ends: publish_params() then destroy_process_group() (nanoGPT, torchtitan);
# no destroy_process_group(); destroy with the step's param gathers still in flight; the model
# dropped (and collected) before destroy
ENDS = ("publish_destroy", "no_destroy", "destroy_in_flight", "drop_then_destroy")
RUN_TIMEOUT_S = 120.0
NOT_COMMITTED = "was written but not committed"  # megabuf/checkpoint/save.py's message
LOAD_LIMIT_S = 1800


@dataclass(frozen=True)
class Run:
    strategy: str
    overlap_param_gather: bool
    checkpoint: str
    end: str

    @property
    def name(self) -> str:
        opg = "+opg" if self.overlap_param_gather else ""
        return f"{self.strategy}{opg}-{self.checkpoint}-{self.end}"


def matrix() -> list[Run]:
    """Every (strategy, end) pair, and for each strategy every checkpoint mode (a Latin
    arrangement: 24 runs rather than the 96 of the full product)."""
    runs = []
    for i, (strategy, opg) in enumerate(STRATEGIES):
        for j, end in enumerate(ENDS):
            ckpt = CHECKPOINTS[(i + j) % len(CHECKPOINTS)]
            runs.append(Run(strategy, opg, ckpt, end))
    return runs


@dataclass(frozen=True)
class Outcome:
    run: Run
    codes: tuple[int, ...]  # per rank: exit status, or -signal
    stderr: tuple[str, ...]
    committed: bool | None  # the checkpoint's metadata is in place (None: no checkpoint)

    @property
    def expect_committed(self) -> bool:
        """A save never waited for is committed at exit unless the script destroyed the
        process group first; then every rank must say so ([Note: a save in flight at exit])."""
        return self.run.checkpoint != "async_unwaited" or self.run.end == "no_destroy"

    def problems(self) -> list[str]:
        bad = [f"rank {r}: {_status(c)}" for r, c in enumerate(self.codes) if c != 0]
        bad += [f"rank {r}: 'terminate called' on stderr" for r, e in enumerate(self.stderr)
                if "terminate called" in e]  # fmt: skip
        if self.committed is not None and self.committed != self.expect_committed:
            bad.append(f"the checkpoint was {'' if self.committed else 'not '}committed")
        if self.committed is False and not all(NOT_COMMITTED in e for e in self.stderr):
            bad.append("a rank did not say that its save was not committed")
        return bad

    @property
    def ok(self) -> bool:
        return not self.problems()

    def describe(self) -> str:
        return f"{self.run.name}: " + ("; ".join(self.problems()) or "ok")


def _status(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


# ---- rank side (in a forked child) --------------------------------------------------------------
def _train(run: Run, ckpt_dir: str) -> None:
    import gc

    import torch
    import torch.distributed as dist

    import megabuf
    from megabuf.testing import PRESETS, build_model, corpus_tokens, gpt_loss, lm_batches

    pgs = megabuf.init_distributed()
    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=True,
        overlap_param_gather=run.overlap_param_gather,
        data_parallel_sharding_strategy=run.strategy,
    )
    model = megabuf.DistributedDataParallel(build_model("gpt_tiny", seed=0), cfg,
                                            process_groups=pgs)  # fmt: skip
    if run.strategy == "no_shard":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = megabuf.build_optimizer(
            model, megabuf.OptimizerConfig(optimizer="adamw", lr=1e-3, clip_grad=1.0)
        )
    gpt = PRESETS["gpt_tiny"]
    tokens = corpus_tokens(20_000, gpt.vocab_size, seed=0)
    rank, local = dist.get_rank(), 2
    lo, hi = rank * local, (rank + 1) * local
    handle = None
    for step in range(5):
        # nanoGPT evaluates on the master process only; under optim_grads_params a forward
        # gathers params, a collective, so every rank evaluates
        if step % 2 == 0 and (rank == 0 or run.strategy == "optim_grads_params"):
            model.eval()
            with torch.no_grad():
                x, y = lm_batches(tokens, 4, gpt.seq_len, 100 + step)
                gpt_loss(model(x[lo:hi]), y[lo:hi]).item()
            model.train()
        if step == 3 and run.checkpoint != "none":
            handle = megabuf.save_checkpoint(
                Path(ckpt_dir) / "ckpt", model, opt, async_save=run.checkpoint != "sync"
            )
            if run.checkpoint == "async":
                handle.wait()
        for micro in range(2):
            model.require_backward_grad_sync = micro == 1
            x, y = lm_batches(tokens, 4, gpt.seq_len, 2 * step + micro)
            (gpt_loss(model(x[lo:hi]), y[lo:hi]) / 2).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if run.end == "drop_then_destroy":  # the script's own references go (a pending save's stay)
        del model, opt
        gc.collect()
        model = opt = None
    _end(run.end, model)


def _end(end: str, model: object) -> None:
    import torch.distributed as dist

    if end == "publish_destroy":
        model.publish_params()  # type: ignore[attr-defined]
    if end != "no_destroy":  # "no_destroy": the script just ends
        dist.destroy_process_group()


def _rank_main(run: Run, rank: int, port: int, ckpt_dir: str, log: str) -> None:
    """In the forked child: stderr to `log`, torchrun's environment, train, then leave through
    the ordinary interpreter exit (SystemExit unwinds to the top; atexit and teardown run)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.dup2(fd, 1)
    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 2,
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}  # fmt: skip
    os.environ.update({k: str(v) for k, v in env.items()})
    _train(run, ckpt_dir)
    sys.stdout.flush()


# ---- parent side --------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Pending:
    """A run whose two ranks were forked and are not all reaped yet."""

    run: Run
    tmp: str
    logs: list[str]
    pids: list[int]
    deadline: float
    codes: dict[int, int]  # rank -> exit status (or -signal), once reaped


def start_run(run: Run) -> Pending:
    """Fork the two ranks of `run`. [Note: no unwinding into the parent]: a rank leaves by
    SystemExit through these frames (and the caller's), so none of them has a `finally` or a
    `with` (the rank would run the parent's clean-up: delete the directory, kill the load)."""
    tmp = tempfile.mkdtemp(prefix="megabuf-exit-")
    port = _free_port()
    logs = [os.path.join(tmp, f"rank{r}.log") for r in range(2)]
    sys.stdout.flush()
    sys.stderr.flush()
    pids = [_fork_rank(run, rank, port, tmp, logs[rank]) for rank in range(2)]
    return Pending(run, tmp, logs, pids, time.monotonic() + RUN_TIMEOUT_S, {})


def poll_run(pending: Pending) -> Outcome | None:
    """Reap what has ended (a rank past the deadline is killed: a hang is a failure too, never
    a hung suite); once both ranks are reaped, the run's outcome (its directory removed)."""
    for rank, pid in enumerate(pending.pids):
        if rank not in pending.codes:
            code = _reap_now(pid, pending.deadline)
            if code is not None:
                pending.codes[rank] = code
    if len(pending.codes) < len(pending.pids):
        return None
    codes = tuple(pending.codes[r] for r in range(len(pending.pids)))
    stderr = tuple(Path(log).read_text(errors="replace") for log in pending.logs)
    committed = None
    if pending.run.checkpoint != "none":
        committed = (Path(pending.tmp) / "ckpt" / "metadata.json").exists()
    shutil.rmtree(pending.tmp, ignore_errors=True)
    return Outcome(pending.run, codes, stderr, committed)


def run_once(run: Run) -> Outcome:
    """Fork the two ranks of `run` and wait for them."""
    pending = start_run(run)
    while (outcome := poll_run(pending)) is None:
        time.sleep(0.02)
    return outcome


def _fork_rank(run: Run, rank: int, port: int, tmp: str, log: str) -> int:
    pid = os.fork()
    if pid != 0:
        return pid
    try:  # the child: it never returns into the parent's loop
        _rank_main(run, rank, port, tmp, log)
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        raise SystemExit(1) from None
    raise SystemExit(0)


def _reap_now(pid: int, deadline: float) -> int | None:
    """The rank's exit status if it ended (killed first if past `deadline`), else None."""
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        return os.waitstatus_to_exitcode(status)
    if time.monotonic() > deadline:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return -int(signal.SIGKILL)
    return None


def run_matrix(runs: list[Run], repeat: int = 1, load: int = 0, verbose: bool = True,
               jobs: int = 1) -> list[Outcome]:  # fmt: skip
    """Every run `repeat` times, `jobs` runs at a time (each run's ranks are then loaded by the
    other runs' too), with `load` busy processes on the CPU throughout (each ends by itself
    after `LOAD_LIMIT_S` if this process dies first)."""
    import megabuf  # noqa: F401  (imported once here; the forked ranks inherit it)

    burner = f"import time\nt = time.time() + {LOAD_LIMIT_S}\nwhile time.time() < t: pass"
    burners = [subprocess.Popen([sys.executable, "-c", burner]) for _ in range(load)]
    todo = [run for _, run in itertools.product(range(repeat), runs)]
    outcomes: list[Outcome] = []
    pending: list[Pending] = []
    while todo or pending:  # no `finally`, no `with`: see [Note: no unwinding into the parent]
        while todo and len(pending) < max(1, jobs):
            pending.append(start_run(todo.pop(0)))
        time.sleep(0.02)
        for p in list(pending):
            outcome = poll_run(p)
            if outcome is not None:
                pending.remove(p)
                outcomes.append(outcome)
                if verbose:
                    print(outcome.describe(), flush=True)
    for b in burners:
        b.kill()
        b.wait()
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--load", type=int, default=2, help="busy processes during the runs")
    parser.add_argument("--only", default="", help="runs whose name contains this")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time")
    args = parser.parse_args(argv)
    runs = [r for r in matrix() if args.only in r.name]
    outcomes = run_matrix(runs, args.repeat, args.load, jobs=args.jobs)
    bad = [o for o in outcomes if not o.ok]
    print(f"{len(outcomes) - len(bad)} passed, {len(bad)} failed")
    for o in bad:
        print(f"--- {o.run.name}\n" + "\n".join(e[-2000:] for e in o.stderr))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
