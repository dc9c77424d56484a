package partitionsync

// The wire codec, for the tests of package partitionsync_test that play a
// forged or misconfigured peer.
var (
	AppendQuery  = appendQuery
	AppendAnswer = appendAnswer
	DecodeAnswer = decodeAnswer
)

const StatusAnswered, StatusRefused = statusAnswered, statusRefused
