"""Where the Controller's state lives: what every backend promises (``interface``), SQLite under
``state_dir`` (``sqlite`` on the file and writer thread of ``db``), and etcd (``etcd``, laid out by
``etcd_layout``, spoken to through our client ``etcd_client``)."""
