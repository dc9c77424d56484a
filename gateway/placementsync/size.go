package placementsync

// The exported encoders below give sizing tools (kvrelay bench's fleet
// scale study) the exact bytes the replicas put on NATS, from the same
// code that publishes them, so that a size estimate cannot drift from the
// wire.

// PlacementMessage is the message PublishPlacement sends for worker's
// placement of hashes (at most MaxHashes of them, as PublishPlacement cuts).
func PlacementMessage(worker string, hashes []uint64) []byte {
	if len(hashes) > MaxHashes {
		hashes = hashes[:MaxHashes]
	}
	return encode(nil, worker, hashes)
}

// PlacementSubject is the subject PublishPlacement sends model's
// placements to under prefix ("" = DefaultSubjectPrefix).
func PlacementSubject(prefix, model string) string {
	if prefix == "" {
		prefix = DefaultSubjectPrefix
	}
	return prefix + "." + subjectToken(model)
}

// LoadSnapshotMessages is the snapshot a replica sharing load publishes
// for its in-flight counts: the non-zero ones, in one message or in parts
// that each fit MaxLoadWorkers entries and maxPayload bytes (a server's
// max_payload; 0: NATS's default, 1 MiB). cut is how many workers were left
// out past MaxLoadParts parts, as the publisher leaves them out.
func LoadSnapshotMessages(id string, counts map[string]int, maxPayload int) (msgs [][]byte, cut int) {
	if maxPayload <= 0 {
		maxPayload = 1 << 20
	}
	return encodeSnapshot(id, 1, counts, maxPayload)
}
