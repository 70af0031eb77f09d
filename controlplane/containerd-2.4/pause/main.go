// Command pause is a pod sandbox's first process: it holds the pod's namespaces open, reaps the
// orphans the pod's containers leave to it (as PID 1 of a shared PID namespace), and exits on SIGINT
// or SIGTERM. The test nodes' containerd imports it as its sandbox image, since registry.k8s.io's
// cannot be pulled here.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range signals {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
