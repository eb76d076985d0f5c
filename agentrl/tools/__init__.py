"""Tools: the protocol, `@tool`, the YAML loader and registry, call parsers, builtin tools."""

from agentrl.tools.base import FunctionTool, Tool, ToolResult, tool

__all__ = ["FunctionTool", "Tool", "ToolResult", "tool"]
