"""The repository's own tests: pytester for the plugin's self-tests. Users need no conftest."""

pytest_plugins = ["pytester"]
