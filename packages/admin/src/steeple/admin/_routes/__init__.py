"""The admin app's routes, one module per area, each handler given an :class:`AdminContext`.

``steeple.admin.app.create_admin_app`` builds the context and the route table.
"""
