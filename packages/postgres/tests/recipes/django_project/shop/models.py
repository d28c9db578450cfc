"""The recipe's one model: an order (its table is created by the test, not by migrate)."""

from django.db import models


class Order(models.Model):  # type: ignore[misc]  # Django ships no type hints
    item = models.CharField(max_length=100)
