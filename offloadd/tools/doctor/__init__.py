"""``offloadd doctor``: the command and its report (``command``), the machine's checks
(``checks``) and those of the configured directories and daemon (``paths``)."""

__all__: list[str] = []
