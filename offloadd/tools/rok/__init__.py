"""``offloadd rok``: the command (``command``), the options checked (``sweep``), one point measured
(``points``), what the points say (``summary``) and the figure (``plot``)."""

__all__: list[str] = []
