"""The parts of SGLang's API the SGLang engine relies on, read from SGLang's source without importing it.

`python tests/sglang_api.py SOURCE.tar.gz` rewrites tests/sglang_api.json from SGLang's `python/`
tree (the tarball in ../shared/sglang-cpu). tests/test_sglang_contract.py checks the engine against
that snapshot on every run, and the snapshot against the tarball when the tarball is present. The
snapshot holds only what the engine uses (plus the whole of a few small request types), so that a
change in SGLang that matters shows up as a diff of a few lines.
"""

from __future__ import annotations

import ast
import json
import sys
import tarfile
from pathlib import Path

SNAPSHOT = Path(__file__).with_name("sglang_api.json")
ROOT = "python/sglang/srt/"
ENGINE_METHODS = ["__init__", "async_generate", "update_weights_from_tensor", "flush_cache",
                  "release_memory_occupation", "resume_memory_occupation", "shutdown"]
# Engine.tokenizer_manager's: its flush can wait for an idle scheduler; abort_request stops a
# request whose caller was cancelled
TOKENIZER_METHODS = ["flush_cache", "abort_request"]
SERVER_ARGS = ["model_path", "device", "dtype", "random_seed", "tp_size", "mem_fraction_static",
               "skip_tokenizer_init", "enable_memory_saver", "log_level", "max_total_tokens",
               "attention_backend", "disable_overlap_schedule", "base_gpu_id", "host", "port", "custom_sigquit_handler"]
ROUTES = ["/generate", "/health_generate", "/update_weights_from_tensor", "/update_weights_from_disk", "/flush_cache",
          "/release_memory_occupation", "/resume_memory_occupation", "/server_info"]
REQUESTS = ["GenerateReqInput", "UpdateWeightsFromTensorReqInput", "UpdateWeightFromDiskReqInput",
            "ReleaseMemoryOccupationReqInput", "ResumeMemoryOccupationReqInput"]


def read_sources(tarball: str | Path) -> dict[str, ast.Module]:
    """The parsed modules this snapshot reads, straight from the tarball's members."""
    names = {"engine": "entrypoints/engine.py", "server_args": "server_args.py", "http": "entrypoints/http_server.py",
             "tokenizer": "managers/tokenizer_control_mixin.py", "tokenizer_manager": "managers/tokenizer_manager.py",
             "io": "managers/io_struct.py", "sampling": "sampling/sampling_params.py", "constants": "constants.py",
             "common": "utils/common.py"}
    wanted = {ROOT + path: key for key, path in names.items()}
    modules: dict[str, ast.Module] = {}
    with tarfile.open(tarball) as tar:
        for member in tar:
            if member.name in wanted:
                modules[wanted[member.name]] = ast.parse(tar.extractfile(member).read())
    missing = sorted(set(names) - set(modules))
    if missing:
        raise FileNotFoundError(f"{tarball}: no {', '.join(ROOT + names[k] for k in missing)}")
    return modules


def find_class(module: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == name)


def fields(cls: ast.ClassDef) -> dict[str, str]:
    """Annotated class attributes → the type (the first argument of `Annotated[...]`/`A[...]`)."""
    out = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            annotation = node.annotation
            if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) in ("A", "Annotated"):
                annotation = annotation.slice.elts[0] if isinstance(annotation.slice, ast.Tuple) else annotation.slice
            out[node.target.id] = ast.unparse(annotation)
    return out


def method(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> dict:
    a = fn.args
    calls_loop = any(isinstance(n, ast.Attribute) and n.attr == "run_until_complete"
                     and ast.unparse(n.value) == "self.loop" for n in ast.walk(fn))
    return {"params": [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs],
            "var_kwargs": a.kwarg is not None, "async": isinstance(fn, ast.AsyncFunctionDef),
            "runs_on_self_loop": calls_loop}


def routes(module: ast.Module) -> dict[str, dict]:
    """FastAPI routes: path → methods, the request type of the handler's `obj` parameter, and its
    other parameters (query parameters)."""
    out: dict[str, dict] = {}
    for fn in module.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body_type = None
        params = [a.arg for a in fn.args.args if a.arg not in ("obj", "request", "raw_request")]
        for arg in fn.args.args:
            if arg.arg == "obj" and arg.annotation is not None:
                text = ast.unparse(arg.annotation)
                body_type = text.removeprefix("Annotated[").split(",")[0].rstrip("]")
        for deco in fn.decorator_list:
            if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)
                    and ast.unparse(deco.func.value) == "app" and deco.args
                    and isinstance(deco.args[0], ast.Constant)):
                continue
            kind = deco.func.attr
            methods = [kind.upper()] if kind in ("get", "post", "put") else []
            for kw in deco.keywords:
                if kw.arg == "methods":
                    methods = [e.value for e in kw.value.elts]
            path = deco.args[0].value
            entry = out.setdefault(path, {"methods": [], "body": body_type, "params": params})
            entry["methods"] = sorted(set(entry["methods"]) | set(methods))
    return out


def module_constant(module: ast.Module, name: str) -> ast.expr:
    return next(n.value for n in module.body if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == name for t in n.targets))


def memory_types(module: ast.Module) -> list[str]:
    """GPU_MEMORY_ALL_TYPES with its names resolved to their string values."""
    return [ast.literal_eval(module_constant(module, e.id)) for e in module_constant(module, "GPU_MEMORY_ALL_TYPES").elts]


def extract(tarball: str | Path) -> dict:
    m = read_sources(tarball)
    engine = {n.name: n for n in find_class(m["engine"], "Engine").body
              if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    tokenizer = {n.name: n for cls in (find_class(m["tokenizer"], "TokenizerControlMixin"),
                                       find_class(m["tokenizer_manager"], "TokenizerManager"))
                 for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    server_args = fields(find_class(m["server_args"], "ServerArgs"))
    all_routes = routes(m["http"])
    unpickler = find_class(m["common"], "SafeUnpickler")
    prefixes = next(n.value for n in unpickler.body if isinstance(n, ast.Assign)
                    and ast.unparse(n.targets[0]) == "ALLOWED_MODULE_PREFIXES")
    return {
        "source": Path(tarball).name,
        "engine_methods": {name: method(engine[name]) for name in ENGINE_METHODS},
        "tokenizer_manager_methods": {name: method(tokenizer[name]) for name in TOKENIZER_METHODS},
        "server_args": {name: server_args[name] for name in SERVER_ARGS},
        "routes": {path: all_routes[path] for path in ROUTES},
        "requests": {name: sorted(fields(find_class(m["io"], name))) for name in REQUESTS},
        "sampling_params": sorted(fields(find_class(m["sampling"], "SamplingParams"))),
        "memory_types": memory_types(m["constants"]),
        "unpickler_allowed_prefixes": sorted(ast.literal_eval(prefixes)),
    }


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/sglang_api.py SGLANG-SOURCE.tar.gz")
    SNAPSHOT.write_text(json.dumps(extract(sys.argv[1]), indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT}")
