"""Drive the recipe project as a client would: create the table, post two orders.

Run in its own interpreter by test_queue_recipes.py (Django's settings are per process),
with DJANGO_SETTINGS_MODULE=project.settings and this directory on the path. Prints one
JSON line per response; the test checks the database.
"""

import json

import django

django.setup()

from django.apps import apps  # noqa: E402 - after setup()
from django.db import connection  # noqa: E402
from django.test import Client  # noqa: E402

with connection.schema_editor() as editor:
    editor.create_model(apps.get_model("shop", "Order"))

client = Client(raise_request_exception=False)
for form in ({"item": "book"}, {"item": "lamp", "declined": "1"}):
    response = client.post("/orders", form)
    print(json.dumps({"status": response.status_code, "body": response.json()}))
