"""Tools that ship with agentrl, registered as `agentrl.tools` entry points."""
