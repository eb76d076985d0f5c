"""Reading a user's YAML file (a recipe, a tool or interaction file): UTF-8 text, PyYAML's safe
loader, and a key repeated in one mapping is an error naming both lines rather than PyYAML's silent
last-one-wins, which would drop a whole section without a word. So is a plain number YAML 1.1
reads as nobody means it (`010` as 8, `1:30` as 90), which the overrides' parser reads as decimal.
An exponent without a dot (`1e-3`), text in YAML 1.1, is the number it is in YAML 1.2 and JSON: as
text it reached mappings that no schema converts (`engine.sglang.extra_args`) as a string."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from agentrl.errors import ConfigError


class RepeatedKey(yaml.YAMLError):
    def __init__(self, key: Any, first_line: int, line: int):
        super().__init__(f"key '{key}' appears twice (lines {first_line} and {line})")
        self.key = key


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key repeated in one mapping raises RepeatedKey instead
    of the last value silently winning."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            first_lines: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` entries may be overridden
                    continue
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    if key in first_lines:
                        raise RepeatedKey(key, first_lines[key], line)
                    first_lines[key] = line
                except TypeError:  # an unhashable key: the safe loader itself refuses it below
                    pass
        return super().construct_mapping(node, deep)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        """PyYAML's, except that a value its constructors fail on (`2024-02-30` read as a date,
        `!!int abc`) is a YAML error at that value's line, not a bare ValueError naming no file."""
        try:
            return super().construct_object(node, deep)
        except yaml.YAMLError:
            raise
        except (ValueError, TypeError, AttributeError, OverflowError) as e:
            shown = repr(node.value) if isinstance(node, yaml.ScalarNode) else "the value"
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read {shown} as {node.tag.rsplit(':', 1)[-1]} ({type(e).__name__}: {e}); "
                "quote it if it is text", node.start_mark) from None


    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        """PyYAML's, except for the YAML 1.1 readings nobody means in a recipe or a tool file: `010`
        is 8 (octal) and `1:30` is 90 (base 60). Such a value is an error at its line saying what
        it read as; `0x0a` and `0b11` say what they are and stay numbers."""
        value = super().construct_yaml_int(node)
        text = node.value.replace("_", "").lstrip("+-")
        if node.style is None and (":" in text or (text.startswith("0") and text.isdigit()
                                                     and value != int(node.value.replace("_", ""), 10))):
            base = "base 60" if ":" in text else "a leading 0 makes it octal"
            raise yaml.constructor.ConstructorError(
                None, None, f"{node.value!r} reads as {value} in YAML 1.1 ({base}); write the number as it is "
                "meant, or quote it if it is text", node.start_mark)
        return value

    def construct_yaml_float(self, node: yaml.ScalarNode) -> float:
        """PyYAML's, except that a base-60 float (`1:30.5`, 90.5) is an error, as in construct_yaml_int."""
        value = super().construct_yaml_float(node)
        if node.style is None and ":" in node.value:
            raise yaml.constructor.ConstructorError(
                None, None, f"{node.value!r} reads as {value} in YAML 1.1 (base 60); write the number as it is "
                "meant, or quote it if it is text", node.start_mark)
        return value


EXPONENT_ONLY_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$")
UniqueKeyLoader.add_implicit_resolver("tag:yaml.org,2002:float", EXPONENT_ONLY_FLOAT, list("-+0123456789"))
UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", UniqueKeyLoader.construct_yaml_int)
UniqueKeyLoader.add_constructor("tag:yaml.org,2002:float", UniqueKeyLoader.construct_yaml_float)


class RecipeDumper(yaml.SafeDumper):
    """yaml.safe_dump's writer, quoting a text that UniqueKeyLoader reads as a number (`1e-5`), so
    that a written recipe (a run's config.yaml) loads back as it was: unquoted, a run named
    `1e-5` wrote a config.yaml whose `name` read as a float."""


RecipeDumper.add_implicit_resolver("tag:yaml.org,2002:float", EXPONENT_ONLY_FLOAT, list("-+0123456789"))


def dump_recipe(data: object, **options: object) -> str:
    return yaml.dump(data, Dumper=RecipeDumper, **options)


def one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def read_utf8(path: str | Path) -> str:
    """A user's text file, or a ConfigError naming the file: unreadable, or the first byte that is
    not UTF-8."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    except OSError as e:  # no permission, a directory, a device that refuses reads
        raise ConfigError(f"{path}: cannot be read ({e.strerror or e})") from None


def load_yaml(path: str | Path) -> Any:
    """A user's YAML file, parsed (None when it holds no document), or a one-line ConfigError naming
    the file: not UTF-8, not valid YAML, or a key repeated in one mapping (with its lines)."""
    text = read_utf8(path)
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)
    except RepeatedKey as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({one_line(e)})") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid YAML (nested too deeply)") from None
