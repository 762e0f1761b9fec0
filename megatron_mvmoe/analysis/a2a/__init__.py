"""Expert-parallel all-to-all volume: the analytic model per dispatcher and layout (analytic), the
counter at the collectives (counter) and the counted measurement of the tiny models against
the analytic bytes (counted), dispatch semantics at cluster scale (semantics, scale,
placement), time on links (link_time), the on-the-wire measurement (wire, wire_worker,
wire_report, wire_page), and the reports (report, volume)."""
