"""The `kerasmulti` command: `demo`, `devices`, `predict`, `launch`.

Device simulation has to happen before TensorFlow initialises its devices, so
the command simulates devices (without GPUs) before anything else runs. Errors a user can fix are printed as one message with a
non-zero exit, not a traceback; Ctrl-C ends it with one line and exit 130, as
a shell reports SIGINT, always: TensorFlow can swallow the KeyboardInterrupt
(inside an import, or in a C++ call that holds the main thread), so the first
Ctrl-C also starts a watchdog that ends the process `GRACE_S` later if it is
still running (`predict`'s output file is safe to stop at any point), and a
second Ctrl-C ends it at once. While TensorFlow and Keras load, the
KeyboardInterrupt waits for the import to end (`_CtrlC.held`). Arguments are
parsed before TensorFlow loads (this module imports nothing heavy, and
`import kerasmulti` waits for `main`), so `--help` and argument errors answer
at once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from typing import Callable

DEFAULT_SIMULATED = 2
INTERRUPTED = 130  # what a shell reports for SIGINT
GRACE_S = 5.0  # after Ctrl-C, how long the command may take to stop by itself


class _CtrlC:
    """The SIGINT handler of `demo`, `devices` and `predict`: KeyboardInterrupt, and a watchdog behind it."""

    def __init__(self, message: str | Callable[[], str], stdout: _Stdout | None = None):
        self.message = message  # a callable says it as things are when Ctrl-C is pressed
        self.stdout = stdout
        self.pressed = False
        self._reported = threading.Lock()
        self._watchdog = None
        self._holding = False

    def __call__(self, signum, frame):
        if self.pressed:  # a second Ctrl-C: the user insists, also while the watchdog works out the line
            self._say("kerasmulti: interrupted")  # unless a line was said
            os._exit(INTERRUPTED)
        self.pressed = True
        self._watchdog = threading.Timer(GRACE_S, self.report_and_exit)
        self._watchdog.daemon = True
        self._watchdog.start()
        if not self._holding:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def held(self):
        """Ctrl-C inside the block raises as it ends; the watchdog runs meanwhile.

        For imports: a KeyboardInterrupt inside TensorFlow's leaves it half
        loaded, and the process could end killed by SIGINT, not with 130.
        """
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
        if self.pressed:
            raise KeyboardInterrupt

    def stand_down(self) -> None:
        """The command stopped by itself: the watchdog has nothing left to do."""
        if self._watchdog is not None:
            self._watchdog.cancel()

    def report(self) -> bool:
        """Prints the one line, once; False if a line was printed already.

        The line is worked out first, outside the lock: stuck there (reading
        predict's file behind h5py's lock), it keeps no other line from being said.
        """
        try:
            message = self.message() if callable(self.message) else self.message
        except Exception:  # the watchdog must still say it and exit
            message = "kerasmulti: interrupted"
        return self._say(message)

    def _say(self, message: str) -> bool:
        """Prints `message` unless a line was printed already; whether it did."""
        if not self._reported.acquire(blocking=False):
            return False
        try:
            if self.stdout is not None and self.stdout.mid_line:  # a progress bar's: the line goes below it
                self.stdout.end_line()
        except Exception:  # the line is said all the same
            pass
        print(message, file=sys.stderr, flush=True)
        return True

    def report_and_exit(self) -> None:
        if self.report():
            os._exit(INTERRUPTED)


class _Stdout:
    """`sys.stdout`, remembering whether its last line is unfinished (a progress bar's)."""

    def __init__(self, stream):
        self.stream = stream
        self.mid_line = False

    def write(self, text: str) -> int:
        if text:
            self.mid_line = not text.endswith("\n")
        return self.stream.write(text)

    def end_line(self) -> None:
        self.write("\n")
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int. Received: {text!r}") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int. Received: {text!r}")
    return value


def _count(text: str) -> int:
    """0 or more (--max-restarts)."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more. Received: {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kerasmulti",
        description="Train and run existing Keras 3 models on several devices.",
    )
    parser.add_argument(
        "--simulate",
        type=_positive_int,
        metavar="N",
        help="without GPUs, split the CPU into N logical devices "
        f"(default {DEFAULT_SIMULATED}, or $KERASMULTI_SIMULATE_DEVICES)",
    )
    # Not required=True: argparse would name the missing command before an unknown option (`--bogus`).
    commands = parser.add_subparsers(dest="command")
    demo = commands.add_parser("demo", help="train a convnet on the digits data set, data-parallel")
    demo.add_argument("--gpus", type=_positive_int, default=None, help="devices to use (default: all)")
    demo.add_argument("--epochs", type=_positive_int, default=5, help="epochs to train (default: 5)")
    demo.add_argument("--batch-size", type=_positive_int, default=128, help="rows per global batch (default: 128)")
    demo.add_argument("--output", default="kerasmulti-demo", help="folder for the saved model")
    commands.add_parser("devices", help="list the devices replicas can use")
    predict = commands.add_parser(
        "predict", help="run a saved model over a data set, data-parallel, into an HDF5 file"
    )
    predict.add_argument("model", help="a .keras or .h5 model file")
    predict.add_argument("input", help="an .h5 file (with --dataset), an .npy file, or a folder of images")
    predict.add_argument("--output", required=True, help="HDF5 file for the results (resumed if it exists)")
    predict.add_argument("--dataset", help="the dataset to read in an .h5 INPUT")
    predict.add_argument("--gpus", type=_positive_int, default=None, help="devices to use (default: all)")
    predict.add_argument("--batch-size", type=_positive_int, default=32, help="rows per global batch (default: 32)")
    predict.add_argument(
        "--import", dest="imports", action="append", default=[], metavar="MODULE",
        help="a module (name or .py file) to import first: one that registers the model's custom layers",
    )
    predict.add_argument(
        "--unsafe-deserialization", action="store_true",
        help="load the Python code of Lambda layers (Keras' safe_mode=False): only for a file you trust",
    )
    launch = commands.add_parser(
        "launch", help="run a script as N worker processes of one TF_CONFIG cluster"
    )
    launch.add_argument("--workers", type=_positive_int, help="local worker processes on free localhost ports")
    launch.add_argument(
        "--devices-per-worker", type=_positive_int,
        help="GPUs per local worker (worker i sees GPUs i*K..i*K+K-1); without GPUs a worker is one replica",
    )
    launch.add_argument("--hosts", help="a real cluster: host1:port,host2:port (with --index)")
    launch.add_argument("--index", type=_int, help="which of --hosts this machine is")
    launch.add_argument(
        "--port", type=_int,
        help="under srun (one task per worker): the first port of the workers on each node (default: from SLURM_JOB_ID)",
    )
    launch.add_argument(
        "--max-restarts", type=_count, default=0, metavar="K",
        help="with --workers: when a worker fails, start all workers again, up to K times "
        "(the script resumes from its ParallelBackupAndRestore backup)",
    )
    # Optional here so that a missing one is named alone (argparse would name the script's args too).
    launch.add_argument("script", nargs="?", help="the Python script each worker runs")
    launch.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def _simulate_without_gpus(requested: int | None, pin_threads: bool) -> None:
    import tensorflow as tf

    import kerasmulti
    from kerasmulti._src import devices

    if requested is None:
        if tf.config.list_physical_devices("GPU"):
            return
        requested = devices.environment_count() or DEFAULT_SIMULATED
    if pin_threads:
        # The demo's throughput: one thread per simulated device, as if each
        # were one core, so "one device" compares like with like (benchmarks/
        # does too). Threading, like devices, is fixed once TensorFlow
        # starts, so it goes first. Other commands keep TensorFlow's threads.
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(requested)
    kerasmulti.simulate_devices(requested)


def _launch(args) -> int:
    from kerasmulti._src.commands import launch as _launch

    return _launch.run(args)


def program() -> int:
    """The `kerasmulti` program (the console script, `python -m kerasmulti`): `main`, then its exit.

    Once the command has finished, Ctrl-C is ignored while the interpreter
    exits (TensorFlow's teardown takes a moment): it could only turn a job
    that is done into a process killed by SIGINT.
    """
    code = main(_ignore_ctrl_c_after=True)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # also after `launch` and `devices`
    return code


def main(argv: list[str] | None = None, _ignore_ctrl_c_after: bool = False) -> int:
    try:
        return _main(argv, _ignore_ctrl_c_after)
    except KeyboardInterrupt:  # before the command's own handler was set: parsing, say
        print("kerasmulti: interrupted", file=sys.stderr, flush=True)
        return INTERRUPTED


def _main(argv: list[str] | None, ignore_ctrl_c_after: bool) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error("the following arguments are required: command")
    # TensorFlow's C++ INFO lines (oneDNN, CPU features) drown the command's
    # output; warnings and errors still show. A value the user set wins. Set
    # here, not at import: a library leaves the user's process alone.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    # The command is kerasmulti's own program: it runs Keras on TensorFlow
    # unless the user chose a backend (which keras_private then refuses).
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    # The launcher stops its workers itself on Ctrl-C, and must not be cut short.
    watched = args.command != "launch" and threading.current_thread() is threading.main_thread()
    stdout = _Stdout(sys.stdout) if watched else None
    if stdout is not None:
        sys.stdout = stdout
    ctrl_c = _CtrlC(lambda: f"kerasmulti: interrupted{_after_interrupt(args)}", stdout)
    previous = signal.signal(signal.SIGINT, ctrl_c) if watched else None
    try:
        code = _run_command(args, ctrl_c)
    except KeyboardInterrupt:
        code = INTERRUPTED
    except Exception:
        # A Ctrl-C inside a C call can surface as another error (numpy's
        # `__array__` under TensorFlow: "SystemError: ... returned a result with
        # an exception set"): after Ctrl-C, any error is the interrupt.
        if not ctrl_c.pressed:
            raise
        code = INTERRUPTED
    finally:
        if watched:
            # `program` ignores Ctrl-C from here on: no gap in which one would kill a finished job.
            signal.signal(signal.SIGINT, signal.SIG_IGN if ignore_ctrl_c_after else previous)
        ctrl_c.stand_down()
        if stdout is not None and sys.stdout is stdout:
            sys.stdout = stdout.stream
    if code == INTERRUPTED or ctrl_c.pressed:
        # Also when TensorFlow swallowed the KeyboardInterrupt and the command ran on.
        ctrl_c.report()
        return INTERRUPTED
    return code


def _after_interrupt(args) -> str:
    """What the one line says after "interrupted": what was kept, and how to go on; said when Ctrl-C is pressed."""
    if args.command == "predict":
        if not _holds_rows(args.output):
            return "; no rows were written yet"
        return f"; the rows written so far stay in {args.output}: run the same command to go on"
    if args.command == "launch":
        from kerasmulti._src.multi_worker.supervisor import RESUME_HINT

        return f"; no worker is left running. {RESUME_HINT}"
    return ""


def _holds_rows(path: str) -> bool:
    """Whether `predict`'s output file exists and holds rows.

    It may run in the watchdog while the main thread is stuck inside an import,
    so it imports nothing: it reads the file with the writer's module if loaded.
    """
    if not os.path.isfile(path):
        return False
    output_file = sys.modules.get("kerasmulti._src.inference.output_file")
    try:
        with output_file.h5py.File(path, "r") as f:
            return output_file.rows_done(f) > 0
    except Exception:  # the writer is not loaded (so this run wrote nothing), or the file is not ours: it is kept
        return True


def _check_gpus(args, existing: list[str]) -> None:
    """Refuses a `--gpus` beyond the devices there are, naming the flags that fix it."""
    if args.gpus is None or args.gpus <= len(existing):
        return
    # Simulated devices are CPUs, which are not offered beside GPUs.
    simulate = "" if any("GPU" in d for d in existing) else f", or put --simulate {args.gpus} before {args.command}"
    raise ValueError(
        f"--gpus {args.gpus} is more than the {len(existing)} devices there are ({', '.join(existing)}). "
        f"Pass --gpus {len(existing)}{simulate}. Received: --gpus={args.gpus}"
    )


def _run_command(args, ctrl_c: _CtrlC) -> int:
    import kerasmulti

    if args.command == "launch":
        try:
            return _launch(args)
        except ValueError as error:
            print(f"kerasmulti: error: {error}", file=sys.stderr)
            return 2
    try:
        if args.command == "predict":
            from kerasmulti._src.commands import paths as _paths

            _paths.check(args)  # before TensorFlow loads: a mistyped path answers at once
        with ctrl_c.held():  # TensorFlow and Keras load whole, or not at all
            _simulate_without_gpus(args.simulate, pin_threads=args.command == "demo")
            if args.command != "devices":
                from kerasmulti._src.commands import demo as _demo
                from kerasmulti._src.commands import predict as _predict
        if args.command != "devices":
            _check_gpus(args, kerasmulti.available_devices())
        if args.command == "devices":
            for device in kerasmulti.available_devices():
                print(device)
            return 0
        if args.command == "predict":
            return _predict.run(args)
        return _demo.run(
            gpus=args.gpus, epochs=args.epochs, batch_size=args.batch_size, output=args.output
        )
    except (ValueError, RuntimeError, OSError) as error:
        if ctrl_c.pressed:  # what the interrupt became: one line says so, not two
            raise KeyboardInterrupt from error
        print(f"kerasmulti: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
