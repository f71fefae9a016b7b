"""The one exception a system under test raises to refuse an action (its own module so that code
which must stay light, such as a standalone reproducer's frozen driver, need not import the spec)."""


class ActionRejected(Exception):
    """The SUT refuses an action (its guard does not hold there)."""
