"""Alarms: the store of active alarms and their history (``store``), what raises and clears them
(``sources``), the WatchAlarms stream (``watch``), ListAlarms paging (``pages``) and the
Alertmanager sink (``alertmanager``)."""
