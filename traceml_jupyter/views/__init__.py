"""Views: how a run is shown. The live chart while it runs, the HTML report (and the facts from
the kernel its checklist reads) when it ends, and which front-end is there to show them."""
