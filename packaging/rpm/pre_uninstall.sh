# %preun of the sciencediscovery RPM. $1: 0 when the package is erased, 1+ on upgrade.
if [ "$1" -eq 0 ]; then
    systemctl --no-reload disable --now runnerd.socket runnerd.service egressd.service npu-brokerd.service runner-router.service >/dev/null 2>&1 || :
fi
