"""``dtrain``: train, check data, print the config, convert GGUF, export, doctor.

    dtrain train -c CONFIG [--section.key VALUE ...]
    dtrain data check FILE [-c CONFIG] [--section.key VALUE ...]
    dtrain convert GGUF_FILE OUT_DIR
    dtrain config [-c CONFIG] [--section.key VALUE ...]
    dtrain export ADAPTER_DIR --base MODEL --out OUT [--gguf TYPE] [--dtype DTYPE] [--allow-base-mismatch]
    dtrain doctor [--steps N] [--max-length L] [--pairs N] [--model PATH] [--no-demo]

User errors print one line ``dtrain: error: ...`` and exit with status 2. SIGTERM and SIGHUP end a
command as Ctrl-C does (``dtrain: interrupted``, status 128 + the signal), so what it was writing is
removed (a half-written folder, a temporary folder); a run in training takes them as a stop (``run.stop``).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import signal
import sys
from pathlib import Path

from .config_text import override_help, split_overrides, take_overrides
from .contract import ERROR_PREFIX, LAUNCHER_VAR, STOP_SIGNALS
from .errors import UserError
from .files import to_devnull, unusable_path


COMMANDS = ("train", "data", "config", "convert", "export", "doctor")
OPTIONS = ("-c", "--config", "--show", "-h", "--help")  # train's, data check's and config's: no override's value


class _ConfigOnce(argparse.Action):
    """``-c``/``--config`` given once: argparse keeps the last, and a first file's keys would be dropped unsaid.

    Raises:
        UserError: a second one, naming both files.
    """

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest) is not None:
            raise UserError(f"-c/--config given twice ({getattr(namespace, self.dest)}, then {values}): give one "
                            f"config file, and change its keys with --section.key VALUE")
        setattr(namespace, self.dest, values)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dtrain", description="LoRA training on MLX: preference pairs (ORPO, DPO, SimPO) "
                                                           "or SFT rows (objective.kind)")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train an adapter (overrides: --section.key VALUE)", epilog=override_help(),
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       usage="dtrain train [-h] [-c CONFIG] [--section.key VALUE ...]")
    t.add_argument("-c", "--config", action=_ConfigOnce, help="YAML config (see configs/demo.yaml)")
    d = sub.add_parser("data", help="inspect training data (preference pairs or SFT rows)")
    dsub = d.add_subparsers(dest="data_command", required=True)
    what = ("report bad and dropped rows and token lengths of the data (overrides: --section.key VALUE, such as "
            "--data.fields or --train.global_batch_pairs; exit status "
            "1 where training would stop on the data: no usable pair, fewer training pairs than "
            "train.global_batch_pairs, no held-out pair for train.keep_best or an adaptive lambda schedule, bad rows "
            "under data.on_bad_row: error)")
    dc = dsub.add_parser("check", help=what, description=what,
                         usage="dtrain data check [-h] [-c CONFIG] [--show N] [--section.key VALUE ...] file")
    dc.add_argument("file", help="a JSONL/JSON/Parquet file, a data folder or a hub dataset id, read as data.train")
    dc.add_argument("-c", "--config", action=_ConfigOnce, help="YAML config for the model/tokenizer and data keys")
    dc.add_argument("--show", type=int, default=0, metavar="N",
                    help="print the first N usable pairs as trained: text with control tokens visible, and ids")
    k = sub.add_parser("config", help="print every config key with its default (or the value from -c and "
                                      "overrides), allowed values and help, as a commented YAML config",
                       usage="dtrain config [-h] [-c CONFIG] [--section.key VALUE ...]")
    k.add_argument("-c", "--config", action=_ConfigOnce,
                   help="YAML config to resolve (checked as for training, but data.train may be left to the command "
                        "line)")
    c = sub.add_parser("convert", help="write an mlx-lm model folder from a GGUF file (or demo)")
    c.add_argument("gguf_file")
    c.add_argument("out_dir")
    e = sub.add_parser("export", help="write the base model with an adapter merged: an mlx-lm folder, "
                                      "and a GGUF file with --gguf")
    e.add_argument("adapter_dir")
    e.add_argument("--base", required=True, help="the model the adapter was trained on (demo, .gguf, folder, hub id)")
    e.add_argument("--out", required=True, help="new folder for the merged model")
    e.add_argument("--gguf", nargs="?", const="f16", metavar="TYPE",
                   help="also write OUT/model-TYPE.gguf in the base GGUF's layout: f32, f16 (default), bf16, "
                        "q8_0 or q4_0")
    e.add_argument("--dtype", default="bfloat16", help="weights of the mlx-lm folder: bfloat16 (default), "
                                                     "float16 or float32")
    e.add_argument("--allow-base-mismatch", action="store_true",
                   help="merge even when --base is not the GGUF file (by sha256) or model folder "
                        "(by content) the adapter was trained on")
    doc = sub.add_parser("doctor", help="print what a bug report needs: MLX, device, memory, BLAS, distributed "
                                        "backends, Python, OS, and a short timed demo run")
    doc.add_argument("--steps", type=int, default=2, help="demo run: optimizer steps (default 2)")
    doc.add_argument("--max-length", type=int, default=128, help="demo run: tokens per side (default 128, as configs/demo.yaml)")
    doc.add_argument("--pairs", type=int, default=4, help="demo run: pairs per step (default 4)")
    doc.add_argument("--model", default="demo", help="demo run: model.path (default: the demo model)")
    doc.add_argument("--no-demo", action="store_true", help="skip the demo run")
    return p


def _error(message: str) -> None:
    """``dtrain: error: MESSAGE`` on stderr in one write: under ./launch stderr is unbuffered, and
    print's two writes (text, then newline) let two ranks' errors run into one line."""
    sys.stderr.write(f"{ERROR_PREFIX}{message}\n")
    sys.stderr.flush()


def _setup_blas() -> None:
    """Load the fastest correct BLAS before MLX and print its line (the launcher printed it for ranks)."""
    choice = _load_mlx()
    if not choice.inherited:
        print(f"dtrain: {choice.line()}", file=sys.stderr, flush=True)


def _load_mlx():
    """Load the fastest correct BLAS (``blas.setup``), then MLX, and have MLX check for its C++ compiler now;
    returns the BLAS choice.

    MLX's CPU backend checks once per process, at the first compiled function it runs (a run's step-0
    evaluation), with ``system("g++ --version")`` (``JitCompiler::available``), and glibc's system() ignores
    SIGINT while the command runs: a Ctrl-C, or a rank wrapper's stop, that came then was discarded, and the
    run trained on. Here the stop signals are blocked, also in the threads the BLAS starts (they inherit the
    mask), so one that comes during the check waits and is delivered after it; one already waiting is
    delivered without the check (ignoring a signal discards it, blocked or not).
    """
    from .blas import setup

    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        choice = setup()
        import mlx.core as mx

        if not signal.sigpending() & set(STOP_SIGNALS):
            mx.compile(lambda x: x + 1)(mx.array(0.0))  # the check runs as the call compiles
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    return choice


def _train(args, overrides, interrupt) -> int:
    from .config import load_config

    cfg = load_config(args.config, overrides)
    _setup_blas()  # before the imports below load MLX
    from .distributed import init_group
    from .run.trainer import train

    interrupt.again()  # the other ranks it stopped would not come: this one would wait joining them
    group = init_group(cfg.distributed.backend, cfg.distributed.collective_timeout_s)
    result = train(cfg, group)
    # the run is over, stopped or finished: a stop signal now (this rank's own, still on its way after the
    # ranks agreed on a stop; or one sent as the run ended) has nothing left to stop, and must not end the exit
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if result.stopped and result.stop_signal is not None and os.environ.get(LAUNCHER_VAR):
        # under ./launch: the launcher tells a stop sent to this rank from one it sent (supervise.Attempt)
        from .launch.rank import Report, report_line, write

        write(report_line(Report("signal", group.rank, stop=signal.Signals(result.stop_signal).name)).encode())
    if group.is_main:
        # a stopped run has said how to continue (trainer.loop); a finished one shows its evaluations (a resume's too)
        if not result.stopped and (summary := result.summary()):
            print(summary)
    return 0


def _data_check(args, overrides) -> int:
    from .config import load_config, parse_override

    if args.show < 0:
        raise UserError(f"data check: --show N must be 0 or more (the first N usable pairs); got {args.show}")
    if not args.file:  # else read as no data.train, which the config would be blamed for
        raise UserError("data check: FILE is empty (''); give a data file, folder or hub dataset id")
    values = {"data.train": args.file, "data.demo_pairs": 0}  # the file named on the command line is the data
    for section, key, value in map(parse_override, overrides):  # another value for them would go unread
        if values.get(f"{section}.{key}", value) != value:
            raise UserError(f"data check: --{section}.{key} is not read: FILE ({args.file}) is the data it checks; "
                            f"remove --{section}.{key}")
    # the file named on the command line is the data, its name taken as it is (a file may be
    # called 2024 or null); a config's demo pairs do not apply
    cfg = load_config(args.config, overrides, values=values)
    _setup_blas()
    from .data import check_file, held_out_source
    from .files import OutputDir
    from .run.checkpoint import recorded_setting

    if cfg.data.template_date is None:  # the day the config's run renders, as its resume does
        day = recorded_setting("auto", OutputDir(cfg.train.output_dir).checkpoints, "data.template_date")
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, template_date=day))
    from .models import load_model
    from .run.held_out import held_out_steering
    from .sampler import for_run
    from .types import example_noun, refuse_ids_past_vocabulary, refuse_single_completions

    loaded = load_model(cfg.model.path, cfg.model.dtype)
    report, n_bad, (train_pairs, held_out) = check_file(args.file, cfg.data, loaded.tokenizer, show=args.show,
                                                        objective=cfg.objective.kind, seed=cfg.train.seed)
    # training's order: bad rows under on_bad_row error, no usable pair, then rows with one completion
    # under a pairwise objective (engine.sft.fit_dataset)
    stop = None
    if n_bad and cfg.data.on_bad_row == "error":
        stop = (f"{args.file}: {n_bad} bad row(s) and data.on_bad_row is 'error' "
                "(training would stop; see the rows listed above)")
    elif not train_pairs:
        stop = (f"{args.file}: no usable {example_noun(cfg.objective.kind)}s (training would stop; see the rows "
                "listed above)")
    elif not held_out and (held := held_out_source(cfg.data, args.file)) is not None:
        stop = (f"no usable held-out {example_noun(cfg.objective.kind)}s in {held} (training would stop; see the rows "
                "listed above)")
    elif held_out is None:  # data.valid_fraction held out rows, none usable
        stop = (f"no usable held-out {example_noun(cfg.objective.kind)}s among the rows data.valid_fraction "
                f"{cfg.data.valid_fraction} held out (training would stop; see the rows listed above)")
    elif cfg.objective.kind != "sft":
        refuse_single_completions((*train_pairs, *held_out), cfg.objective.kind, args.file)
    print(report)
    if stop is not None:
        _error(stop)
        return 1
    try:  # the trainer's own refusals: ids past the model's vocabulary, no held-out pairs to steer by, fewer
        # training pairs than a step takes
        refuse_ids_past_vocabulary((*train_pairs, *held_out), loaded.model)
        held_out_steering(cfg, len(train_pairs), len(held_out))
        for_run(cfg, train_pairs)
    except UserError as err:
        _error(f"{err} (training would stop)")
        return 1
    return 0


def _config(args, overrides) -> int:
    from .config import load_config
    from .config_checks import unread_keys
    from .config_text import describe
    from .notices import notice

    cfg = load_config(args.config, overrides, need_data=False) if args.config is not None or overrides else None
    for line in unread_keys(cfg) if cfg is not None else ():  # as the run's notices say it
        notice(line)
    print("# dtrain config: key: value  # help [allowed values]; defaults live in dtrain/config.py")
    print(describe(cfg))
    return 0


def _convert(args) -> int:
    from .models import convert_gguf

    out = convert_gguf(args.gguf_file, args.out_dir)
    print(f"wrote mlx-lm model folder {out}")
    return 0


def _export(args) -> int:
    from .models.export import export_adapter
    from .notices import notice

    result = export_adapter(args.adapter_dir, args.base, args.out, gguf_type=args.gguf, dtype=args.dtype,
                            allow_base_mismatch=args.allow_base_mismatch, report=notice)
    print(f"wrote mlx-lm model folder {result.folder} ({args.dtype}); "
          f"run it with: mlx_lm.generate --model {result.folder} --prompt ...")
    if result.gguf is not None:
        types = ", ".join(f"{name} x{n}" for name, n in sorted(result.tensor_types.items()))
        print(f"wrote GGUF {result.gguf}: tensor types {types}")
        if result.f16_fallback:
            print(f"  F16 instead of {args.gguf.upper()} (rows not a multiple of 32): {', '.join(result.f16_fallback)}")
        print(f"wrote Ollama {result.modelfile}: ollama create NAME -f {result.modelfile}")
        if result.quant_warning():
            print(f"warning: {result.quant_warning()}", file=sys.stderr)
    return 0


def _doctor(args) -> int:
    import platform

    blas = _load_mlx()
    from .doctor import demo_lines, device_error, system_lines

    if args.steps < 1 or args.pairs < 1 or args.max_length < 8:
        raise UserError("doctor: --steps and --pairs must be >= 1, --max-length >= 8")
    for option, value in (("--steps", args.steps), ("--pairs", args.pairs), ("--max-length", args.max_length)):
        if value >= 2**62:  # else refused as the demo run's keys, no one's (data.demo_pairs: twice --pairs)
            raise UserError(f"doctor: {option} must be below 2**62; got {value}")
    if not args.model:  # else refused as the demo run's model.path, a key not given
        raise UserError("doctor: --model is empty (''); give demo, a .gguf file, a model folder or a hub id")
    print("dtrain doctor (paste all of it into a report)", flush=True)
    for line in system_lines(blas.line() if platform.system() == "Linux" else None):
        print(line, flush=True)
    if not args.no_demo and device_error() is not None:
        print("demo run: skipped: MLX cannot use its device (the device line says why)", flush=True)
    elif not args.no_demo:
        for line in demo_lines(args.steps, args.max_length, args.pairs, args.model):
            print(line, flush=True)
    return 0


def _gguf_before_adapter(argv: list[str]) -> list[str]:
    """``export ... --gguf ADAPTER_DIR``: ``--gguf``'s TYPE is optional, so argparse gave it the adapter folder
    that followed; a value that is no GGUF type but an existing folder is that folder, moved before ``--gguf``
    (a mistyped type is left to be named as one)."""
    from .models.export import GGUF_TYPES

    i = argv.index("--gguf") if "--gguf" in argv else -1
    if 0 <= i < len(argv) - 1 and argv[i + 1].lower() not in GGUF_TYPES and Path(argv[i + 1]).expanduser().is_dir():
        return argv[:i] + [argv[i + 1], "--gguf"] + argv[i + 2:]
    return argv


class Interrupted(KeyboardInterrupt):
    """A stop signal (``signum``) raised as Ctrl-C's KeyboardInterrupt: the default action of SIGTERM and SIGHUP
    ends the process where it stands, leaving what ``files.atomic_folder`` and temporary folders would remove."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _Interrupt:
    """A command's handler of the stop signals (:func:`main`): raises :class:`Interrupted`, and keeps each signal
    (``received``). Python runs a handler wherever the main thread is, and in a weakref callback or a ``__del__``
    its exception is printed ('Exception ignored in ...') and lost: :meth:`again` raises a kept one again, before
    a rank joins its group and when a run's own stop handlers take over (``run.stop.StopRequest.install``)."""

    def __init__(self):
        self.received: list[int] = []

    def __call__(self, signum, _frame):
        self.received.append(signum)
        if signum == signal.SIGHUP:
            to_devnull(1, 2)  # its terminal is gone: a write there fails (EIO)
        raise Interrupted(signum)

    def again(self) -> None:
        """Raise the first stop signal received, if any (:class:`Interrupted`)."""
        if self.received:
            self(self.received[0], None)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dtrain`` command; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    interrupt = _Interrupt()
    previous = {sig: signal.signal(sig, interrupt) for sig in STOP_SIGNALS}
    try:
        return _main(argv, interrupt)
    finally:
        for sig, handler in previous.items():
            if signal.getsignal(sig) is interrupt:  # not where train left them ignored for its exit (_train)
                signal.signal(sig, handler)


def _main(argv: list[str], interrupt: _Interrupt) -> int:
    # `dtrain -c cfg train`: argparse would call the config path an invalid command
    command = next((i for i, a in enumerate(argv) if a in COMMANDS), None)
    if command and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        _error(f"options go after the command: dtrain {' '.join(argv[command:] + argv[:command])}")
        return 2
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # a rank wrapper starts us with them blocked
        # overrides out first, as ./launch takes them: argparse would read the VALUE of one that
        # stands before `data check`'s FILE as FILE (`--data.valid held.jsonl pairs.jsonl`)
        options, overrides = take_overrides(argv, OPTIONS) if argv[:1] in (["train"], ["data"], ["config"]) else (argv, [])
        options = _gguf_before_adapter(options) if argv[:1] == ["export"] else options
        args, extra = _parser().parse_known_args(options)
        if extra and args.command in ("convert", "export", "doctor"):
            raise UserError(f"unexpected argument(s) {' '.join(extra)}: dtrain {args.command} takes no config "
                            f"overrides; its options: dtrain {args.command} --help")
        split_overrides(extra)  # what is left is neither an option nor an override: named
        if args.command == "train":
            return _train(args, overrides, interrupt)
        if args.command == "data":
            return _data_check(args, overrides)
        if args.command == "config":
            return _config(args, overrides)
        if args.command == "doctor":
            return _doctor(args)
        return _export(args) if args.command == "export" else _convert(args)
    except UserError as err:
        _error(str(err))
        return getattr(err, "exit_status", 2)  # distributed.CollectiveError: 4 (a restart may succeed)
    except KeyboardInterrupt as err:
        sys.stderr.write("dtrain: interrupted\n")  # one write, as _error's
        sys.stderr.flush()
        return 128 + getattr(err, "signum", signal.SIGINT)
    except BrokenPipeError:  # stdout closed early (``dtrain config | head``): not an error of dtrain's
        to_devnull(sys.stdout.fileno())  # so the exit's flush does not raise again
        return 0
    except OSError as err:  # a path given longer than a file name may be, wherever it is first looked at
        if err.errno != errno.ENAMETOOLONG:
            raise
        _error(unusable_path(str(err.filename), err))
        return 2


if __name__ == "__main__":
    sys.exit(main())
