"""scripts/deepep_trace.py: DeepEP's test run with each bench_kineto period saved per process (the patch must
reach spawned children), and the per-kernel table of those traces (durations, idle before, cross-rank start)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from harness.scripts import ROOT, load_script


def _trace(path, base_ns, kernels):
    events = [{"cat": "kernel", "name": n, "ts": ts, "dur": dur} for n, ts, dur in kernels]
    events.append({"cat": "cpu_op", "name": "aten::empty", "ts": 0.0, "dur": 1.0})  # not a kernel: ignored
    path.write_text(json.dumps({"baseTimeNanoseconds": base_ns, "traceEvents": events}))


def test_table_durations_idle_and_cross_rank_start(tmp_path):
    mod = load_script("scripts/deepep_trace.py")
    # rank 0: dispatches at 100 (idle 10 after the kernel ending at 90) and 150 (idle 0); rank 1's trace base is
    # 5 µs later, so on the common clock its dispatches start at 103 (idle 8) and 153 (idle 3): 3 µs after rank 0's
    _trace(tmp_path / "trace.rank0.0.json", 0, [
        ("allreduce", 50.0, 40.0),
        ("void omniep::em::dispatch_kernel<128>(Args)", 100.0, 30.0),
        ("void omniep::em::combine_kernel<7168>(Args)", 130.0, 20.0),
        ("void omniep::em::dispatch_kernel<128>(Args)", 150.0, 34.0),
        ("void omniep::em::combine_kernel<7168>(Args)", 184.0, 22.0),
    ])
    _trace(tmp_path / "trace.rank1.0.json", 5000, [
        ("allreduce", 45.0, 45.0),
        ("void omniep::em::dispatch_kernel<128>(Args)", 98.0, 27.0),
        ("void omniep::em::combine_kernel<7168>(Args)", 125.0, 20.0),
        ("void omniep::em::dispatch_kernel<128>(Args)", 148.0, 36.0),
        ("void omniep::em::combine_kernel<7168>(Args)", 184.0, 27.0),
    ])
    rows = {(r["kernel"], r["rank"]): r for r in mod.summarise(
        {r: mod.kernels(str(tmp_path / f"trace.rank{r}.0.json")) for r in (0, 1)}, ["dispatch", "combine"])}
    d0, d1 = rows[("dispatch", 0)], rows[("dispatch", 1)]
    assert d0["calls"] == 2 and d0["mean_us"] == 32.0 and d0["median_us"] == 32.0
    assert d0["first_us"] == 30.0 and d0["max_us"] == 34.0
    assert d0["idle_before_us"] == 5.0 and d1["idle_before_us"] == 5.5
    assert d0["start_vs_other_us"] == -3.0 and d1["start_vs_other_us"] == 3.0
    assert rows[("combine", 1)]["mean_us"] == 23.5
    assert d0["name"] == "void omniep::em::dispatch_kernel"
    out = mod.table(str(tmp_path), ["dispatch", "combine"])
    assert "period 0" in out and out.count("| void omniep::em::dispatch_kernel |") == 2


def test_run_saves_every_spawned_process_trace_and_stdout(tmp_path):
    """The runner's patches of utils.bench_kineto and utils.init_dist reach torch.multiprocessing.spawn's children
    (which re-run the main module as __mp_main__); a stand-in for DeepEP's test and utils, same import shape, runs
    on the CPU."""
    deepep = tmp_path / "deepep"
    deepep.mkdir()
    (deepep / "utils.py").write_text(textwrap.dedent("""
        def init_dist(local_rank, num_local_ranks, port):
            import torch.distributed as dist
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                    world_size=num_local_ranks, rank=local_rank)

        def bench_kineto(fn, kernel_names, trace_path=None, **kwargs):
            if trace_path is not None:
                with open(trace_path, "w") as f:
                    f.write('{"traceEvents": []}')
            return fn()
    """))
    (deepep / "fake_test.py").write_text(textwrap.dedent("""
        import argparse
        import torch
        from utils import bench_kineto, init_dist

        def test_loop(local_rank, num_local_ranks, args):
            import torch.distributed as dist
            init_dist(local_rank, num_local_ranks, args.port)
            print(f"line of rank {local_rank}", flush=True)
            for per_period in (1, 2, 1):  # (a hook period: several kernels per call, left untraced)
                bench_kineto(lambda: None, ("dispatch", "combine"), num_kernels_per_period=per_period)
            dist.destroy_process_group()

        if __name__ == '__main__':
            parser = argparse.ArgumentParser()
            parser.add_argument('--num-processes', type=int)
            parser.add_argument('--port', type=int)
            args = parser.parse_args()
            torch.multiprocessing.spawn(test_loop, args=(args.num_processes, args), nprocs=args.num_processes)
    """))
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out, prefix = tmp_path / "out", tmp_path / "stdout"
    env = dict(os.environ, PYTHONPATH=f"{deepep}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    subprocess.run([sys.executable, str(ROOT / "scripts/deepep_trace.py"), "run", "--out", str(out),
                    "--rank-stdout", str(prefix), str(deepep / "fake_test.py"),
                    "--", "--num-processes", "2", "--port", str(port)],
                   env=env, check=True, timeout=120)
    assert sorted(os.listdir(out)) == [f"trace.rank{r}.{n}.json" for r in (0, 1) for n in (0, 2)]
    for r in (0, 1):  # each process's stdout in its own file
        assert (tmp_path / f"stdout.rank{r}").read_text() == f"line of rank {r}\n"
