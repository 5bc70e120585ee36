# %postun of the sciencediscovery RPM. $1: 0 when the package is erased, 1+ on upgrade.
# The token in /etc/sciencediscovery, the data in /var/lib/sciencediscovery and the users
# stay (RPM has no purge).
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || :
fi
if [ "$1" -ge 1 ]; then
    # Upgrade: restart what was running; never start anything.
    systemctl try-restart egressd.service npu-brokerd.service runnerd.service runner-router.service >/dev/null 2>&1 || :
fi
