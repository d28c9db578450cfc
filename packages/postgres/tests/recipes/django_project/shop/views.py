"""Django: enqueue in the view's transaction, on Django's own connection (psycopg 3)."""

from django.conf import settings
from django.db import connection, transaction
from django.http import HttpRequest, JsonResponse

from steeple.postgres.queue import Task, enqueue_sync

from .models import Order

send_receipt: Task[dict[str, int]] = Task("send-receipt")


class PaymentDeclined(Exception):
    pass


def place_order(request: HttpRequest) -> JsonResponse:
    try:
        with transaction.atomic():
            order = Order.objects.create(item=request.POST["item"])
            # On Django's PostgreSQL backend with psycopg 3, connection.connection is the
            # psycopg.Connection running this transaction (open inside atomic()).
            queued = enqueue_sync(
                connection.connection,
                send_receipt,
                {"order": order.pk},
                schema=settings.STEEPLE_QUEUE_SCHEMA,
            )
            if request.POST.get("declined"):
                raise PaymentDeclined  # inside atomic(): the order and its task roll back
    except PaymentDeclined:
        return JsonResponse({"error": "payment declined"}, status=402)
    return JsonResponse({"order": order.pk, "task": queued.id})
