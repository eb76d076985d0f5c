"""Tool YAML files: loading, entry points, and one-line errors through the real CLI."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import pytest

from agentrl.errors import ConfigError
from agentrl.tools.base import FunctionTool, argument_problem
from agentrl.tools.builtin.gsm8k import CheckAnswer
from agentrl.tools.loader import load_tool_files, load_tools


class Schemaless:
    """A tool class that forgot its schema (referenced from YAML in the tests below)."""

    async def create(self, instance_id, **kwargs): return instance_id
    async def execute(self, instance_id, arguments): return "ok"
    async def reward(self, instance_id): return None
    async def release(self, instance_id): return None


class SyncMethods(Schemaless):
    schema = {"type": "function", "function": {"name": "sync_methods", "parameters": {"type": "object"}}}

    def execute(self, instance_id, arguments): return "blocks the loop"  # noqa: E704


class ComputedSchema(Schemaless):
    @property
    def schema(self):
        return {"type": "function", "function": {"name": "computed", "parameters": {"type": "object"}}}


class Options(Schemaless):
    """Takes any option, each as text."""

    schema = {"type": "function", "function": {"name": "options", "parameters": {"type": "object"}}}

    def __init__(self, **options: str):
        self.options = options


class NoArguments(Schemaless):
    schema = {"type": "function", "function": {"name": "no_arguments", "parameters": {"type": "object"}}}

    async def execute(self, instance_id): return "ok"  # noqa: E704 - the episode passes the arguments too


class RefusingSet:
    """A ToolSet whose server refuses to list its tools."""

    def tools(self):
        raise RuntimeError("server said no")


def write(tmp_path, body: str, name: str = "tools.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_repository_tool_files_load():
    calc, check = load_tools("tool_configs/gsm8k.yaml")
    assert isinstance(calc, FunctionTool) and calc.schema["function"]["name"] == "calculator"
    assert isinstance(check, CheckAnswer) and check.tolerance == 1e-6


def test_yaml_schema_overrides_and_config_reaches_constructor(tmp_path):
    path = write(tmp_path, """
        tools:
          - class: tests.test_tool_loader:Schemaless
            schema:
              type: function
              function: {name: ping, description: Ping., parameters: {type: object, properties: {}}}
          - class: check_answer
            config: {tolerance: 0.5}
        """)
    ping, check = load_tools(path)
    assert ping.schema["function"]["name"] == "ping" and check.tolerance == 0.5


@pytest.mark.parametrize("body,message", [
    ("tools:\n  - class: agentrl.tools.builtin.nope:calculator\n",
     "tool #1 (class 'agentrl.tools.builtin.nope:calculator'): cannot import module 'agentrl.tools.builtin.nope'"),
    ("tools:\n  - class: agentrl.tools.builtin.calculator:nope\n",
     "tool #1 (class 'agentrl.tools.builtin.calculator:nope'): module 'agentrl.tools.builtin.calculator' has no attribute 'nope'"),
    ("tools:\n  - class: tests.test_tool_loader:Schemaless\n",
     "tool #1 (class 'tests.test_tool_loader:Schemaless'): no schema: the class defines none, so the entry needs a 'schema' key"),
    ("tools:\n  - class: calculator\n  - class: agentrl.tools.builtin.calculator:calculator\n",
     "tool 'calculator' (#2): duplicate name, tool #1 has it too"),
    ("tools:\n  - class: calculator\n    confg: {}\n",
     "tool #1 (class 'calculator'): unknown key 'confg' (allowed: class, config, schema)"),
    ("tools:\n  - class: check_answer\n    config: {tolerence: 1}\n",
     "tool #1 (class 'check_answer'): config: unknown key 'tolerence' (allowed: max_attempts, tolerance)"),
    ("tools:\n  - class: check_answer\n    config: {tolerance: [0.1]}\n",
     "tool #1 (class 'check_answer'): config.tolerance = [0.1]: expected float (Input should be a valid number)"),
    ("tools:\n  - class: check_answer\n    config: {tolerance: 1e-6x}\n",
     "tool #1 (class 'check_answer'): config.tolerance = '1e-6x': expected float "
     "(Input should be a valid number, unable to parse string as a number)"),
    ("tools:\n  - class: tests.test_tool_loader:Schemaless\n    schema: {type: function, function: check}\n",
     "tool #1 (class 'tests.test_tool_loader:Schemaless'): schema.function must be a mapping with name, "
     "description and parameters"),
    ("tools:\n  - class: calculator\n    schema: {type: function, function: {name: c, descripton: Add.}}\n",
     "tool 'c' (#1): schema.function: unknown key 'descripton' (allowed: description, name, parameters, strict)"),
    ("tools:\n  - class: calculator\n    schema: {type: function, function: {name: c, paramters: {type: object}}}\n",
     "tool 'c' (#1): schema.function: unknown key 'paramters' (allowed: description, name, parameters, strict)"),
    ("tools:\n  - class: calculator\n    schema: {type: function, fuction: {name: c}}\n",
     "tool #1 (class 'calculator'): schema: unknown key 'fuction' (allowed: function, type)"),
    ("tools:\n  - class: calculator\n    schema: {type: function, function: {name: c, parameters: {type: object, "
     "properties: {x: {$ref: '#/$defs/missing'}}}}}\n",
     "tool 'c' (#1): schema.function.parameters: $ref '#/$defs/missing' does not point to a place inside the schema"),
    ("tools:\n  - class: calculator\n    schema: {type: function, function: {name: c, parameters: {type: object, "
     "properties: {x: {items: {$ref: 'https://example.com/item.json'}}}}}}\n",
     "tool 'c' (#1): schema.function.parameters: $ref 'https://example.com/item.json' does not point to a place "
     "inside the schema"),
    ("tools:\n  - class: calculator\n    schema: {type: function, function: {name: c, parameters: {type: object, "
     "properties: {x: {type: banana}}}}}\n", "tool 'c' (#1): schema.function.parameters is not valid JSON Schema"),
    ("tools:\n  - class: not_registered\n", "'not_registered' is neither 'module:attr' nor a registered"),
    ("tools:\n  - class: calculator\n    schema: {type: function, function: {name: c, parameters: {$schema: 7, "
     "type: object}}}\n", "tool 'c' (#1): schema.function.parameters is not valid JSON Schema (AttributeError:"),
    ("tools:\n  - class: tests.test_tool_loader:ComputedSchema\n    schema: {type: function, function: {name: c}}\n",
     "tool 'c' (#1): key 'schema': the class does not take a schema"),
    ("tools:\n  - class: tests.test_tool_loader:RefusingSet\n",
     "tool #1 (class 'tests.test_tool_loader:RefusingSet'): listing its tools failed: RuntimeError: server said no"),
    ("tools:\n  - class: tests.test_tool_loader:SyncMethods\n",
     "'tests.test_tool_loader:SyncMethods' method(s) execute must be 'async def' (or write the tool as a plain function)"),
    ("tools:\n  - class: check_answer\n    config: []\n", "tool #1 (class 'check_answer'): key 'config' must be a "
     "mapping, not list"),
    ("tools:\n  - class: check_answer\n    config: false\n", "key 'config' must be a mapping, not bool"),
    ("tools:\n  - class: 123\n", "tool #1: key 'class' must be text ('module:attr' or a registered name), not 123"),
    ("tool:\n  - class: calculator\n", "expected a mapping with exactly one key 'tools' holding a list"),
    ("tools: [\n", "not valid YAML"),
    ('tools:\n  - class: calculator\n    schema: {type: function, function: {name: "c\\n", parameters: {type: object}}}\n',
     "tool 'c\\n' (#1): schema.function.name 'c\\n' must match"),  # `$` would match before the newline
    # both loaded: the model would have read a list as the tool's description
    ("tools:\n  - class: calculator\n    schema: {type: function, function: {name: c, description: [a, b]}}\n",
     "tool 'c' (#1): schema.function.description must be text, not list"),
    ("tools:\n  - class: calculator\n    schema: {type: function, function: {name: c, strict: 'yes'}}\n",
     "tool 'c' (#1): schema.function.strict must be true or false, not 'yes'"),
    ("tools:\n  - class: python\n    config: {timeout_s: .nan}\n",
     "failed: wall_s must be a positive finite number, got nan"),  # `nan <= 0` is False
    ("tools:\n  - class: python\n    config: {cpu_s: .inf}\n", "failed: cpu_s must be a positive finite number, got inf"),
    ("tools:\n  - class: tests.test_tool_loader:pick\n    schema: {type: function, function: {name: pick, parameters: "
     "{$id: 'urn:pick', type: object, properties: {mode: {nullable: true, allOf: [{type: string}]}, "
     "more: {$ref: 'urn:pick#/properties/mode/allOf/0'}}}}}\n",
     "tool 'pick' (#1): schema.function.parameters: $ref 'urn:pick#/properties/mode/allOf/0' does not point to a "
     "place inside the schema once 'nullable: true' is spelt as JSON Schema (write a $ref into a nullable node as "
     "'#/...', a pointer from the top of the parameters)"),
    # PyYAML's constructors raised a bare ValueError naming no file (a date that is none, a bad tag).
    ("tools:\n  - class: check_answer\n    config: {tolerance: 2024-02-30}\n",
     "not valid YAML (cannot read '2024-02-30' as timestamp (ValueError: day is out of range for month); quote it "
     "if it is text in \"<unicode string>\", line 3, column 25"),
    ("tools:\n  - class: check_answer\n    config: {tolerance: !!int abc}\n", "cannot read 'abc' as int"),
    ("tools: " + "[" * 3000 + "\n", "not valid YAML (nested too deeply)"),
    # A number key next to text keys: sorting them raised a TypeError that hid the key.
    ("tools:\n  - class: calculator\n    1: a\n    b: c\n",
     "tool #1 (class 'calculator'): unknown key '1' (allowed: class, config, schema)"),
    # A value of a **options: str constructor was checked against that type by its name only, and
    # then failed with a KeyError.
    ("tools:\n  - class: tests.test_tool_loader:Options\n    config: {mode: 5}\n",
     "config.mode = 5: expected str (Input should be a valid string)"),
    ("tools:\n  - class: tests.test_tool_loader:NoArguments\n",
     "'tests.test_tool_loader:NoArguments' method execute(instance_id) cannot be called as "
     "execute(instance_id, arguments) (too many positional arguments)"),
    ("tools:\n  - class: math:sqrt\n    schema: {type: function, function: {name: root, parameters: {type: object, "
     "properties: {}}}}\n", "sqrt() takes ['x'] by position only, and a tool's arguments are passed by name"),
    ("tools:\n  - class: tests.test_tool_loader:Schemaless\n    schema: {type: function, function: {name: s, "
     "parameters: {type: object, properties: {on: {type: boolean}}}}}\n",
     "tool 's' (#1): schema.function.parameters.properties: key True is not text (YAML reads unquoted on, off, yes "
     "and no as booleans, digits as numbers: quote it)"),
    # YAML reads an unquoted date as a date, which the metaschema lets through as a value: the
    # template failed on it later, naming nothing, and calls were checked against the date.
    ("tools:\n  - class: calculator\n    schema: {type: function, function: {name: c, parameters: {type: object, "
     "properties: {expression: {type: string, default: 2024-01-31}}}}}\n",
     "tool 'c' (#1): schema.function.parameters.properties.expression.default: '2024-01-31' is a date, not a JSON "
     "value (YAML reads an unquoted date or time as one: quote it)"),
    ("tools:\n  - class: calculator\n    schema: {type: function, function: {name: c, parameters: {type: object, "
     "properties: {expression: {enum: [a, .nan]}}}}}\n",
     "tool 'c' (#1): schema.function.parameters.properties.expression.enum[1]: nan is not a JSON number"),
])
def test_bad_tool_files(tmp_path, body, message):
    path = write(tmp_path, body)
    with pytest.raises(ConfigError) as err:
        load_tools(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)


def test_config_values_are_converted_to_the_constructors_types(tmp_path):
    # YAML 1.1 reads 1e-6 (no dot) as text; the float parameter takes it as a number.
    path = write(tmp_path, "tools:\n  - class: check_answer\n    config: {tolerance: 1e-6}\n")
    [check] = load_tools(path)
    assert check.tolerance == 1e-06 and type(check.tolerance) is float
    asyncio.run(check.create("e", ground_truth="#### 3"))
    assert asyncio.run(check.execute("e", {"answer": "3"})).text == "Correct."


def test_refs_that_resolve_inside_the_schema_load(tmp_path):
    path = write(tmp_path, """
        tools:
          - class: calculator
            schema:
              type: function
              function:
                name: c
                strict: true
                parameters:
                  type: object
                  properties: {expression: {$ref: '#/$defs/text'}, more: {type: array, items: {$ref: '#/$defs/text'}}}
                  required: [expression]
                  $defs: {text: {type: string}}
        """)
    with pytest.raises(ConfigError, match=r"the schema of 'c' has properties \['more'\] that calculator\(\) takes no "
                                          r"parameter for \(it takes \['expression'\]\)$"):
        load_tools(path)  # the refs resolve; the extra property is what stops it
    path.write_text(path.read_text().replace("class: calculator", "class: tests.test_tool_loader:calculate_more"))
    [calc] = load_tools(path)
    assert calc.schema["function"]["parameters"]["properties"]["expression"] == {"$ref": "#/$defs/text"}


def calculate_more(expression: str, more: list[str] | None = None) -> str:
    """The calculator with extra inputs, for the schema above."""
    return expression


def _look_up(key):  # no type hints, no docstring: only the schema it is wrapped with describes it
    return f"value of {key}"


look_up = FunctionTool(_look_up, max_workers=3, schema={"type": "function", "function": {
    "name": "look_up", "description": "Look a key up.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}})


def test_a_function_tool_made_in_a_module_keeps_its_own_schema_and_threads(tmp_path):
    """The loader rebuilt it from the bare function: a schema that was the only description of
    the function failed to load ('cannot derive one'), one that renamed the tool was dropped."""
    path = write(tmp_path, "tools:\n  - class: tests.test_tool_loader:look_up\n")
    [tool] = load_tools(path)
    assert tool is not look_up and tool.schema == look_up.schema and tool.max_workers == 3
    assert asyncio.run(tool.execute("i", {"key": "k"})).text == "value of k"
    path = write(tmp_path, "tools:\n  - class: tests.test_tool_loader:look_up\n    schema: {type: function, function: "
                           "{name: find, parameters: {type: object, properties: {key: {type: string}}, "
                           "required: [key]}}}\n")
    [renamed] = load_tools(path)
    assert renamed.schema["function"]["name"] == "find" and look_up.schema["function"]["name"] == "look_up"


def test_an_entry_point_plugin_that_exits_on_import_is_named(tmp_path, monkeypatch):
    """A plug-in that parses the command line when imported: through an entry point, its
    SystemExit ended the process with the plug-in's usage message, naming no tool file."""
    (tmp_path / "quits_on_import.py").write_text("import sys\nsys.exit(2)\n")
    dist = tmp_path / "quits_on_import-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: quits-on-import\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[agentrl.tools]\nquitter = quits_on_import:Search\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write(tmp_path, "tools:\n  - class: quitter\n")
    with pytest.raises(ConfigError) as e:
        load_tools(path)
    assert str(e.value) == (f"{path}: tool #1 (class 'quitter'): cannot load entry point 'quitter' = "
                            "'quits_on_import:Search' (SystemExit: 2)")


def test_duplicate_across_files(tmp_path):
    a = write(tmp_path, "tools:\n  - class: calculator\n", "a.yaml")
    b = write(tmp_path, "tools:\n  - class: calculator\n", "b.yaml")
    with pytest.raises(ConfigError, match="b.yaml: tool 'calculator': duplicate name"):
        load_tool_files([a, b])


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentrl.cli", *args], capture_output=True, text=True, timeout=120)


def test_cli_check_prints_schema():
    done = cli("tools", "check", "tool_configs/calculator.yaml")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("tool_configs/calculator.yaml: calculator (FunctionTool)\n{")
    assert '"required": [\n        "expression"\n      ]' in done.stdout


@pytest.mark.parametrize("body,problem", [
    ("tools:\n  - class: agentrl.tools.nowhere:Calc\n", "tool #1 (class 'agentrl.tools.nowhere:Calc'): cannot import"),
    ("tools:\n  - class: tests.test_tool_loader:Schemaless\n", "): no schema"),
    ("tools:\n  - class: calculator\n  - class: calculator\n", "tool 'calculator' (#2): duplicate name"),
])
def test_cli_check_fails_with_one_line(tmp_path, body, problem):
    path = write(tmp_path, body)
    done = cli("tools", "check", str(path))
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"agentrl: error: {path}: ") and problem in lines[0]
    assert "Traceback" not in done.stderr


def test_a_tool_file_with_a_repeated_key_names_both_lines(tmp_path):
    from agentrl.errors import ConfigError
    from agentrl.tools.loader import load_tool_files

    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - class: agentrl.tools.builtin.calculator.calculator\n"
                    "    class: agentrl.tools.builtin.calculator.calculator\n")
    with pytest.raises(ConfigError, match=f"^{path}: key 'class' appears twice \\(lines 2 and 3\\)$"):
        load_tool_files([path])


def test_a_tool_file_the_recipe_lists_but_that_is_not_there_names_the_recipe_key(tmp_path):
    from agentrl.errors import ConfigError
    from agentrl.tools.loader import load_tool_files

    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=f"^rollout.tool_configs: {missing}: file not found$"):
        load_tool_files(["tool_configs/calculator.yaml", missing])


def pick(items=None, more=None, mode=None, only=None) -> str:
    """A function for the schemas of the tests below."""
    return f"{items} {more} {mode} {only}"


NULLABLE_REFS = """
tools:
  - class: tests.test_tool_loader:pick
    schema:
      type: function
      function:
        name: pick
        parameters:
          type: object
          nullable: true
          $defs: {count: {type: integer}}
          properties:
            items: {type: array, nullable: true, items: {type: object, properties: {n: {$ref: '#/$defs/count'}}}}
            more: {$ref: '#/properties/items/items'}
            mode: {enum: [fast, slow], nullable: true}
            only: {const: 1, nullable: true}
"""


def test_a_ref_into_a_nullable_node_still_resolves_when_calls_are_checked(tmp_path):
    """`nullable: true` was spelt by wrapping its node in an anyOf, which moved everything inside
    it: a file whose `$ref` pointed there (or with `nullable` at the top, beside `$defs`) loaded,
    and then every call was refused as a broken schema (PointerToNowhere)."""
    [tool] = load_tools(write(tmp_path, NULLABLE_REFS))
    assert argument_problem(tool, {"items": [{"n": 1}], "more": {"n": 2}, "mode": None, "only": None}) is None
    assert argument_problem(tool, {"items": None, "mode": "fast", "only": 1}) is None
    assert argument_problem(tool, {"more": {"n": "two"}}) == "bad arguments for pick: 'two' is not of type 'integer'."
    assert argument_problem(tool, {"items": [{"n": 1.5}]}) == "bad arguments for pick: 1.5 is not of type 'integer'."
    assert argument_problem(tool, {"mode": "medium"}) == ("bad arguments for pick: 'medium' is not one of "
                                                          "['fast', 'slow', None].")
    assert argument_problem(tool, {"only": 2}) == "bad arguments for pick: 2 is not one of [1, None]."
    assert asyncio.run(tool.execute("e", {"items": None, "more": {"n": 2}})).text == "None {'n': 2} None None"
    # what the model reads is the schema as written
    assert tool.schema["function"]["parameters"]["properties"]["items"]["type"] == "array"


class ClosingSet:
    """A ToolSet (as a server entry is) that records its `close()`; `broken` gives its tool a
    schema whose `$ref` points nowhere."""

    closed: list[str] = []

    def __init__(self, name: str, broken: bool = False):
        self.name, self.broken = name, broken

    def tools(self):
        return [Served(self)]

    def close(self):
        ClosingSet.closed.append(self.name)


class Served(Schemaless):
    """The one tool of a ClosingSet, named after it."""

    def __init__(self, source: ClosingSet):
        self.source = source
        properties = {"x": {"$ref": "#/$defs/nowhere"}} if source.broken else {}
        self.schema = {"type": "function", "function": {"name": source.name, "parameters": {
            "type": "object", "properties": properties}}}


def served(name: str, broken: bool = False) -> str:
    return f"  - {{class: tests.test_tool_loader:ClosingSet, config: {{name: {name}, broken: {str(broken).lower()}}}}}\n"


@pytest.mark.parametrize("files,closed", [
    ([served("a") + served("b", broken=True)], ["b", "a"]),  # the entry whose tool is refused, then the one before
    ([served("a") + "  - class: tests.test_tool_loader:nowhere\n"], ["a"]),
    ([served("a") + served("a")], ["a", "a"]),  # a repeated name: both entries' servers
    ([served("a"), "  - class: tests.test_tool_loader:nowhere\n"], ["a"]),  # a later file that fails
    ([served("a"), served("b") + served("a")], ["a", "b", "a"]),  # ... or repeats a name
], ids=["refused_member", "failed_entry", "repeated_name", "later_file", "repeated_across_files"])
def test_a_tool_file_that_fails_closes_every_server_it_opened(tmp_path, files, closed):
    """Servers the earlier entries or files had started (MCP stdio children) ran until the
    process exited."""
    from tests.test_tool_loader import ClosingSet as Loaded  # the class the loader imports, by that name

    Loaded.closed = []
    paths = [write(tmp_path, "tools:\n" + body, f"tools{i}.yaml") for i, body in enumerate(files)]
    with pytest.raises(ConfigError):
        load_tool_files(paths)
    assert Loaded.closed == closed
