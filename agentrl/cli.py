"""`agentrl <command>`: parse arguments, call one function; a ConfigError becomes one line and exit
status 2 (nothing ran), a RunFailed one line and exit status 1 (the run stopped), a Ctrl-C one line
and exit status 130, and in the recipe commands SIGTERM or SIGHUP one line and 128 + the signal's
number."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from agentrl.errors import ConfigError, RunFailed, Terminated


# command → (module, function taking a RecipeConfig); imported only when that command runs
RECIPE_COMMANDS = {
    "train": ("agentrl.train", "train", "RL training: rollouts, advantages, policy updates, weight sync"),
    "sft": ("agentrl.trainer.sft", "run_sft", "supervised warm-up on multi-turn conversations"),
    "eval": ("agentrl.rollout.run", "run_eval", "accuracy on held-out tasks"),
    "rollout": ("agentrl.rollout.run", "run_rollout", "run episodes and write trajectories to JSONL"),
}
# the device keys each command puts models on (SFT trains where the policy does): a CUDA one must exist
DEVICE_KEYS = {"train": ("engine.device", "trainer.device"), "sft": ("trainer.device",), "eval": ("engine.device",),
               "rollout": ("engine.device",), "serve": ("engine.device",)}
# the directories each command writes its results to: checked before any work, which they would end
OUTPUT_KEYS = {"train": ("output_dir",), "sft": ("sft.output",), "eval": ("output_dir",),
               "rollout": ("output_dir",), "serve": ()}


def _recipe_command(args: argparse.Namespace) -> int:
    import importlib

    from agentrl.recipe import load_recipe

    module, function, _ = RECIPE_COMMANDS[args.command]
    # a bad recipe stops before any heavy import
    config = load_recipe(args.recipe, args.overrides, for_training=args.command == "train",
                         devices=DEVICE_KEYS[args.command], outputs=OUTPUT_KEYS[args.command])
    _allocator(args)
    getattr(importlib.import_module(module), function)(config)
    return 0


def _allocator(args: argparse.Namespace) -> None:
    """Run on tcmalloc where it is installed (agentrl/allocator.py: this may re-execute the command).
    Only for the process's own command line: `main([...])` called from a program (a notebook, a
    script) would re-execute that program, not the command it was given."""
    from agentrl.allocator import OPT_OUT, active_allocator, find_tcmalloc, use_tcmalloc

    name = use_tcmalloc() if args.own_command_line else active_allocator()
    hint = ""
    if name == "system" and os.environ.get(OPT_OUT) != "system":
        hint = (" (faster on CPU: install libtcmalloc-minimal4)" if find_tcmalloc() is None else
                " (called from a program: start it with TCMALLOC_RELEASE_RATE=0 LD_PRELOAD=<libtcmalloc> for "
                "tcmalloc as agentrl runs it)")
    print(f"agentrl: memory allocator {name}{hint}", file=sys.stderr)


def _serve(args: argparse.Namespace) -> int:
    from agentrl.recipe import load_recipe, to_yaml

    # a bad recipe stops before the model loads
    config = load_recipe(args.recipe, args.overrides, devices=DEVICE_KEYS["serve"])
    _allocator(args)
    print(to_yaml(config), file=sys.stderr)  # the effective config, as the other recipe commands print it
    from agentrl.serve.server import run_serve

    run_serve(config, args.host, args.port)
    return 0


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"'{text}' is not a port number (0-65535; 0 picks a free one)")
    return int(text)


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


def _view(args: argparse.Namespace) -> int:
    from agentrl.view import run_view

    run_view(args.run_dir, steps=args.steps, out=args.out, model=args.model)
    return 0


def _plot(args: argparse.Namespace) -> int:
    from agentrl.plot import run_plot

    run_plot(args.run_dirs, out=args.out)
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from agentrl.doctor import run_doctor

    return run_doctor(args.model, tools=args.tools, chat_template=args.chat_template, parser=args.parser)


def _add_inspection_commands(commands: argparse._SubParsersAction) -> None:
    view = commands.add_parser("view", help="an HTML page of a run's trajectories (turns, tokens, loss mask)")
    view.add_argument("run_dir", help="a run's output directory")
    view.add_argument("--steps", help="comma-separated steps to include, e.g. 1,5 (default: all)")
    view.add_argument("--out", help="where to write the page (default: RUN_DIR/view.html)")
    view.add_argument("--model", help="tokenizer to decode with (default: model.path in RUN_DIR/config.yaml)")
    view.set_defaults(func=_view)
    plot = commands.add_parser("plot", help="PNG plots of metrics.jsonl per step, several runs overlaid")
    plot.add_argument("run_dirs", nargs="+", metavar="run_dir")
    plot.add_argument("--out", help="directory for the PNG files (default: FIRST_RUN/plots)")
    plot.set_defaults(func=_plot)
    doctor = commands.add_parser("doctor", help="check a chat template for tool use and token-exact training")
    doctor.add_argument("--model", required=True, help="local model directory, hub id or builtin name")
    doctor.add_argument("--tools", help="tool YAML file (default: the builtin calculator)")
    doctor.add_argument("--chat-template", help="'hermes' or a Jinja file (default: the model's own)")
    doctor.add_argument("--parser", default="hermes", help="function-call parser (default: hermes)")
    doctor.set_defaults(func=_doctor)


def _tools_serve(args: argparse.Namespace) -> int:
    import math
    import os

    from agentrl.tools.remote import token_problem

    token = args.token or os.environ.get("AGENTRL_TOOL_TOKEN")
    if not token:
        raise ConfigError("tools serve needs a bearer token: pass --token or set AGENTRL_TOOL_TOKEN")
    problem = token_problem(token)
    if problem:  # no client could send it: every request would get 401
        raise ConfigError(f"{'--token' if args.token else 'AGENTRL_TOOL_TOKEN'}: {problem}")
    limits = {"--max-concurrency": args.max_concurrency, "--max-body-bytes": args.max_body_bytes,
              "--max-instances": args.max_instances, "--instance-ttl": args.instance_ttl,
              "--call-timeout": args.call_timeout, "--max-output-chars": args.max_output_chars}
    for option, value in limits.items():
        if not (math.isfinite(value) and value > 0):  # nan passed `value <= 0`
            raise ConfigError(f"{option} must be a positive number, got {value}")
    from agentrl.tools.server import ServerSettings, serve

    serve(args.file, args.host, args.port, ServerSettings(token, *limits.values()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentrl", description="Train LLM agents on multi-turn tool use.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (_, _, text) in RECIPE_COMMANDS.items():
        command = commands.add_parser(name, help=text)
        command.add_argument("recipe", help="recipe YAML file")
        command.add_argument("overrides", nargs="*", default=[],  # a default: argparse lists them as required
                             help="dotted key=value overrides, e.g. rollout.group_size=8")
        command.set_defaults(func=_recipe_command)
    serve = commands.add_parser("serve", help="an OpenAI-compatible chat endpoint on the recipe's model")
    serve.add_argument("recipe", help="recipe YAML file")
    serve.add_argument("overrides", nargs="*", default=[],
                       help="dotted key=value overrides, e.g. rollout.temperature=0.7")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=_port, default=8000, help="port to listen on (default: 8000; 0: a free one)")
    serve.set_defaults(func=_serve)
    tools = commands.add_parser("tools", help="inspect tools").add_subparsers(dest="tools_command", required=True)
    check = tools.add_parser("check", help="validate tool YAML files and print each tool's schema")
    check.add_argument("files", nargs="+")
    check.set_defaults(func=_tools_check)
    listing = tools.add_parser("list", help="tools registered through the agentrl.tools entry points")
    listing.set_defaults(func=_tools_list)
    _add_inspection_commands(commands)
    serve = tools.add_parser("serve", help="serve a tool file over HTTP (bearer token, limits, /stats)")
    serve.add_argument("file", help="tool YAML file")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_port, default=8765, help="port to listen on (default: 8765; 0: a free one)")
    serve.add_argument("--token", help="bearer token clients must send (default: $AGENTRL_TOOL_TOKEN)")
    serve.add_argument("--max-concurrency", type=int, default=32, help="tool calls running at once")
    serve.add_argument("--max-body-bytes", type=int, default=1_000_000, help="largest request body")
    serve.add_argument("--max-instances", type=int, default=4096, help="live tool instances at most")
    serve.add_argument("--instance-ttl", type=float, default=600.0, help="seconds before an unused instance is released")
    serve.add_argument("--call-timeout", type=float, default=60.0,
                       help="seconds a tool call may take, waiting for a slot included")
    serve.add_argument("--max-output-chars", type=int, default=1_000_000,
                       help="characters of a tool's output sent back; the rest is cut with a marker")
    serve.set_defaults(func=_tools_serve)
    return parser


def _terminate(signum: int, frame: object) -> None:
    raise Terminated(signum)


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with overrides anywhere after the recipe: argparse ends a positional list at
    the first option, so `serve R --port 9 a=1` left `a=1` unrecognised (and its intermixed parsing
    does not take subcommands)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    args.own_command_line = argv is None  # sys.argv: the command may be re-executed as typed
    Terminated.latest = None  # a signal of an earlier main() in this process says nothing of this one
    # Without this, atexit and finally blocks never run. `serve` too: uvicorn shuts down gracefully
    # on SIGTERM, then puts back the handler it found and raises the signal again, which by default
    # ended the process before its engine closed (a launched SGLang server stayed up). Not for
    # `tools serve`: it must exit then even while a tool's call that ignores cancellation still runs.
    for signum in (signal.SIGTERM, signal.SIGHUP) if args.func in (_recipe_command, _serve) else ():
        if signal.getsignal(signum) == signal.SIG_DFL:
            signal.signal(signum, _terminate)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"agentrl: error: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"agentrl: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        terminated = Terminated.behind(e)
        if terminated is None:
            print("agentrl: interrupted", file=sys.stderr)
            return 130
        cause = f": {terminated.cause}" if terminated.cause else ""
        print(f"agentrl: terminated by {signal.Signals(terminated.signum).name}{cause}", file=sys.stderr)
        return 128 + terminated.signum  # as a shell reports a command ended by that signal


if __name__ == "__main__":
    sys.exit(main())
