"""``dtrain``: train, check data, convert GGUF.

    dtrain train -c CONFIG [--section.key VALUE ...]
    dtrain data check FILE [-c CONFIG] [--section.key VALUE ...]
    dtrain convert GGUF_FILE OUT_DIR

User errors print one line ``dtrain: error: ...`` and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys

from .errors import UserError


def split_overrides(extra: list[str]) -> list[str]:
    """``["--train.steps", "5", "--model.path=x"]`` -> ``["train.steps=5", "model.path=x"]``.

    Raises:
        UserError: an argument that is not ``--section.key`` or lacks a value.
    """
    out, i = [], 0
    while i < len(extra):
        arg = extra[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise UserError(f"unexpected argument {arg!r}: overrides look like --section.key VALUE")
        if "=" in arg:
            out.append(arg[2:])
            i += 1
        else:
            if i + 1 >= len(extra):
                raise UserError(f"override {arg} needs a value")
            out.append(f"{arg[2:]}={extra[i + 1]}")
            i += 2
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dtrain", description="ORPO + LoRA preference training on MLX")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train an adapter (overrides: --section.key VALUE)")
    t.add_argument("-c", "--config", help="YAML config (see configs/demo.yaml)")
    d = sub.add_parser("data", help="inspect preference data")
    dsub = d.add_subparsers(dest="data_command", required=True)
    dc = dsub.add_parser("check", help="report bad rows and token lengths of a file (overrides: --data.key VALUE; "
                                       "exit status 1 when there are bad rows and data.on_bad_row is error)")
    dc.add_argument("file")
    dc.add_argument("-c", "--config", help="YAML config for the model/tokenizer and data keys")
    c = sub.add_parser("convert", help="write an mlx-lm model folder from a GGUF file")
    c.add_argument("gguf_file")
    c.add_argument("out_dir")
    return p


def _train(args, overrides) -> int:
    from .config import load_config
    from .distributed import init_group
    from .trainer import train

    cfg = load_config(args.config, overrides)
    group = init_group(cfg.distributed.backend, cfg.distributed.collective_timeout_s)
    result = train(cfg, group)
    if group.is_main:
        if result.stopped:
            print(f"stopped after step {result.steps}; continue with --train.resume auto")
        elif summary := result.summary():  # from the run's evaluations, those before a resume included
            print(summary)
    return 0


def _data_check(args, overrides) -> int:
    from .config import load_config
    from .data import check_file
    from .models import load_model

    # the file named on the command line is the data (a config's demo pairs do not apply)
    cfg = load_config(args.config, [*overrides, f"data.train={args.file}", "data.demo_pairs=0"])
    loaded = load_model(cfg.model.path, cfg.model.dtype)
    report, n_bad = check_file(args.file, cfg.data, loaded.tokenizer)
    print(report)
    return 1 if n_bad and cfg.data.on_bad_row == "error" else 0


def _convert(args) -> int:
    from .models import convert_gguf

    out = convert_gguf(args.gguf_file, args.out_dir)
    print(f"wrote mlx-lm model folder {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dtrain`` command; returns the exit status."""
    args, extra = _parser().parse_known_args(argv)
    try:
        overrides = split_overrides(extra)
        if args.command == "train":
            return _train(args, overrides)
        if args.command == "data":
            return _data_check(args, overrides)
        if extra:
            raise UserError(f"unexpected arguments {' '.join(extra)}")
        return _convert(args)
    except UserError as err:
        print(f"dtrain: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dtrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
