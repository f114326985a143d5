"""A directory that ``offloadd run`` puts first on ``PYTHONPATH``: it holds only a
``sitecustomize`` that installs offloadd's start-up hook and then runs the next one."""

__all__: list[str] = []
