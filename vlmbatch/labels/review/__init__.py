"""People in the loop: a job's answers reviewed in Label Studio and fed back to ``calibrate``.

``export.py`` makes the tasks (one per image, the model's answers as predictions, most
borderline first) and the labelling configuration; ``annotations.py`` reads Label Studio's
JSON and JSON_MIN exports back as labels; ``studio.py`` talks to a running Label Studio
over its HTTP API; ``loop.py`` is what the two
``vlmbatch review`` commands do with them.
"""

from vlmbatch.labels.review.loop import export_tasks, import_labels
from vlmbatch.labels.review.studio import Studio

__all__ = ["Studio", "export_tasks", "import_labels"]
