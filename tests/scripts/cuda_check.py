"""CUDA checks of tensormp's torch support (issue 8). Run on a machine with a CUDA GPU::

    python tests/scripts/cuda_check.py

Prints one line per check, ``PASS name`` or ``FAIL name: why``, then a summary, and exits 0
when every check passed, 1 otherwise (also when CUDA is not available). Self-contained: needs
only torch (a CUDA build) and tensormp. Every wait is bounded (``TIMEOUT_S``).

Checks
------
* roundtrip: a CUDA tensor goes to a consumer process through a tensormp Queue (CUDA IPC);
  the consumer's in-place write is visible to the producer.
* same-storage: two views of one storage in one message, and the storage sent again later,
  arrive as one storage in the consumer.
* producer-keeps-alive: the producer drops its only reference right after ``put()`` and
  churns the caching allocator; the consumer still reads the right values.
* parameter-grad: a CUDA ``Parameter`` stays a ``Parameter``, its ``.grad`` travels and is
  shared (the consumer's write to the grad is visible to the producer).
* conj-view: a conjugate view arrives with its conjugate bit (correct values).
* non-leaf-refused: a non-leaf tensor that requires grad raises in ``put()``, in the caller.
* producer-exited: a producer process puts a CUDA tensor and exits; the consumer's ``get()``
  raises ``tensormp.HandleError`` naming the producer, without crashing or hanging.
"""

from __future__ import annotations

import sys
import time
import traceback

import torch

import tensormp as mp

TIMEOUT_S = 60


def consumer(inq, outq):
    """Runs commands from the producer: ("describe" | "inc" | "same" | "check" | "grad", obj)."""
    kept = []
    while True:
        cmd, obj = inq.get(timeout=TIMEOUT_S)
        try:
            if cmd == "stop":
                return
            if cmd == "inc":  # add 1 in place and report
                kept.append(obj)
                obj.add_(1)
                torch.cuda.synchronize()
                outq.put(("ok", obj.device.type))
            elif cmd == "same":  # obj = [a, b, c]: data pointers of their storages
                kept.append(obj)
                outq.put(("ok", [t.untyped_storage().data_ptr() for t in obj]))
            elif cmd == "again":  # is obj's storage the one of the first "same" tensor?
                first = next(k for k in kept if isinstance(k, list))[0]
                same = obj.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                outq.put(("ok", same))
            elif cmd == "keep":  # hold it, read it later
                kept.append(obj)
                outq.put(("ok", None))
            elif cmd == "check":  # the last kept tensor's values, read now
                outq.put(("ok", kept[-1].cpu().tolist()))
            elif cmd == "grad":
                kept.append(obj)
                with torch.no_grad():
                    obj.grad.add_(1)
                torch.cuda.synchronize()
                outq.put(("ok", (type(obj).__name__, obj.requires_grad, obj.grad.cpu().tolist())))
            elif cmd == "values":
                outq.put(("ok", (obj.is_conj(), obj.resolve_conj().cpu().tolist())))
        except BaseException as e:  # report, keep serving
            outq.put(("error", f"{type(e).__name__}: {e}"))


def producer_then_exit(q, done):
    t = torch.arange(8, device="cuda", dtype=torch.float32)
    q.put(t)
    done.put("sent")
    q.close()
    q.join_thread()  # the message is in the socket; then this process exits


def _ask(inq, outq, cmd, obj):
    inq.put((cmd, obj))
    status, value = outq.get(timeout=TIMEOUT_S)
    if status != "ok":
        raise AssertionError(f"consumer failed: {value}")
    return value


def main() -> int:
    results: list[tuple[str, bool, str]] = []

    def check(name, fn):
        try:
            fn()
            results.append((name, True, ""))
            print(f"PASS {name}", flush=True)
        except BaseException as e:  # noqa: BLE001 - report every failure
            detail = f"{type(e).__name__}: {e}"
            results.append((name, False, detail))
            print(f"FAIL {name}: {detail}", flush=True)
            traceback.print_exc()

    if not torch.cuda.is_available():
        print("FAIL cuda-available: torch.cuda.is_available() is False (CPU-only torch build, "
              "or no GPU visible)")
        return 1
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{torch.cuda.get_device_name(0)}", flush=True)

    ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
    inq, outq = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consumer, args=(inq, outq), daemon=True)
    p.start()
    try:
        def roundtrip():
            t = torch.zeros(1000, device="cuda")
            assert _ask(inq, outq, "inc", t) == "cuda"
            torch.cuda.synchronize()
            assert t.sum().item() == 1000, t[:4]

        def same_storage():
            base = torch.arange(10.0, device="cuda")
            ptrs = _ask(inq, outq, "same", [base, base[2:], base[5:]])
            assert ptrs[0] == ptrs[1] == ptrs[2], ptrs
            assert _ask(inq, outq, "again", base[1:]) is True

        def producer_keeps_alive():
            n = 1 << 20
            t = torch.arange(n, device="cuda", dtype=torch.float32)
            inq.put(("keep", t))
            del t
            junk = [torch.full((n,), -1.0, device="cuda") for _ in range(8)]  # reuse bait
            torch.cuda.empty_cache()
            assert outq.get(timeout=TIMEOUT_S) == ("ok", None)
            del junk
            values = _ask(inq, outq, "check", None)
            assert values[:3] == [0.0, 1.0, 2.0] and values[-1] == float(n - 1), values[-3:]

        def parameter_grad():
            w = torch.nn.Parameter(torch.ones(4, device="cuda"))
            w.grad = torch.full((4,), 2.0, device="cuda")
            kind, requires_grad, grad = _ask(inq, outq, "grad", w)
            assert (kind, requires_grad, grad) == ("Parameter", True, [3.0] * 4)
            torch.cuda.synchronize()
            assert w.grad.tolist() == [3.0] * 4, "the consumer's grad write is not visible"

        def conj_view():
            z = (torch.arange(4.0) * (1 + 2j)).to(torch.complex64).cuda()
            is_conj, values = _ask(inq, outq, "values", z.conj())
            assert is_conj and values == z.conj().resolve_conj().cpu().tolist(), values

        def non_leaf_refused():
            x = torch.ones(3, device="cuda", requires_grad=True) * 2
            try:
                inq.put(("keep", x))
            except RuntimeError as e:
                assert "non-leaf" in str(e), e
            else:
                raise AssertionError("put() of a non-leaf tensor did not raise")

        def producer_exited():
            q, done = ctx.Queue(), ctx.Queue()
            prod = ctx.Process(target=producer_then_exit, args=(q, done))
            prod.start()
            assert done.get(timeout=TIMEOUT_S) == "sent"
            prod.join(TIMEOUT_S)
            assert prod.exitcode is not None, "the producer did not exit"
            t0 = time.monotonic()
            try:
                q.get(timeout=TIMEOUT_S)
            except mp.HandleError as e:
                assert "has exited" in str(e) and str(prod.pid) in str(e), e
            else:
                raise AssertionError("a CUDA tensor of an exited producer was rebuilt")
            assert time.monotonic() - t0 < 30

        check("roundtrip", roundtrip)
        check("same-storage", same_storage)
        check("producer-keeps-alive", producer_keeps_alive)
        check("parameter-grad", parameter_grad)
        check("conj-view", conj_view)
        check("non-leaf-refused", non_leaf_refused)
        check("producer-exited", producer_exited)
    finally:
        try:
            inq.put(("stop", None))
        except Exception:  # noqa: BLE001
            pass
        p.join(TIMEOUT_S)
        if p.exitcode is None:
            p.kill()
            p.join(5)
    failed = [name for name, ok, _ in results if not ok]
    if p.exitcode not in (0, None):
        failed.append(f"consumer-exit (exit code {p.exitcode})")
        print(f"FAIL consumer-exit: exit code {p.exitcode}")
    print(f"{len(results) - len([r for r in results if not r[1]])}/{len(results)} checks passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
