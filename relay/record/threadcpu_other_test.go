//go:build !linux

package record

import "time"

func threadCPU() time.Duration { return 0 }
