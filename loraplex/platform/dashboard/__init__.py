"""The admin dashboard (issue 7): server-rendered pages at /admin over the admin API's own code paths.

auth.py: sign-in sessions and CSRF; signin.py: the sign-in pages and static files; routes.py: the
overview and tenant pages and forms; views.py: what they show (roll-ups, quota store, engine);
charts.py: SVG bar geometry; pages.py: rendering.

Paths: /admin, /admin/login, /admin/logout, /admin/static/{name} and /admin/ui/...; none collides with
the admin JSON API (/admin/tenants, /admin/keys, /admin/usage, /admin/engine).
"""

from fastapi import APIRouter

from loraplex.platform.dashboard import routes, signin

router = APIRouter()
router.include_router(signin.router)
router.include_router(routes.router)
