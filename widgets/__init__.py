"""sdpipe.widgets: the notebook layer (ipywidgets and plotly).

``Dashboard(run)`` follows a running training live; ``Dashboard(result)``
replays a finished one.  The core (``import sdpipe``) does not need this
package or its dependencies.
"""

try:
    import anywidget  # noqa: F401
    import ipywidgets  # noqa: F401
    import plotly  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"sdpipe.widgets needs ipywidgets and plotly: pip install 'sdpipe[notebook]' ({e})") from None

from sdpipe.widgets.dashboard import Dashboard
from sdpipe.widgets.view import CATEGORIES, RunView

__all__ = ["CATEGORIES", "Dashboard", "RunView"]
