"""The one error type that the command line turns into a single line and exit code 2."""


class UserError(Exception):
    """Bad input (registry entry, config, argument, coefficient file): one clear line, exit 2."""
