"""`agentrl <command>`: parse arguments, call one function, turn ConfigError into one line + exit 2."""

from __future__ import annotations

import argparse
import json
import sys

from agentrl.errors import ConfigError


def _rollout(args: argparse.Namespace) -> int:
    from agentrl.config import load_recipe
    from agentrl.rollout.run import run_rollout

    run_rollout(load_recipe(args.recipe, args.overrides))
    return 0


def _train(args: argparse.Namespace) -> int:
    from agentrl.config import load_recipe
    from agentrl.train import train

    train(load_recipe(args.recipe, args.overrides))
    return 0


def _sft(args: argparse.Namespace) -> int:
    from agentrl.config import load_recipe
    from agentrl.trainer.sft import run_sft

    run_sft(load_recipe(args.recipe, args.overrides))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from agentrl.config import load_recipe
    from agentrl.rollout.run import run_eval

    run_eval(load_recipe(args.recipe, args.overrides))
    return 0


def _tools_check(args: argparse.Namespace) -> int:
    from agentrl.tools.loader import load_tools

    for path in args.files:
        for t in load_tools(path):
            print(f"{path}: {t.schema['function']['name']} ({type(t).__name__})")
            print(json.dumps(t.schema, indent=2))
    return 0


def _tools_list(args: argparse.Namespace) -> int:
    from agentrl.tools.loader import registered_tools

    for name, ref in sorted(registered_tools().items()):
        print(f"{name:<20} {ref}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentrl", description="Train LLM agents on multi-turn tool use.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, func, text in (("train", _train, "RL training: rollouts, advantages, policy updates, weight sync"),
                             ("sft", _sft, "supervised warm-up on multi-turn conversations"),
                             ("eval", _eval, "accuracy on held-out tasks"),
                             ("rollout", _rollout, "run episodes and write trajectories to JSONL")):
        command = commands.add_parser(name, help=text)
        command.add_argument("recipe", help="recipe YAML file")
        command.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. rollout.group_size=8")
        command.set_defaults(func=func)
    tools = commands.add_parser("tools", help="inspect tools").add_subparsers(dest="tools_command", required=True)
    check = tools.add_parser("check", help="validate tool YAML files and print each tool's schema")
    check.add_argument("files", nargs="+")
    check.set_defaults(func=_tools_check)
    listing = tools.add_parser("list", help="tools registered through the agentrl.tools entry points")
    listing.set_defaults(func=_tools_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"agentrl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
